"""benchmarks/sweep.py without servers: arms, prompts, resume, /metrics deltas, merge, ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import sweep  # noqa: E402

SCRAPE_BEFORE = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 500.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 200.0
vllm_av:draft_tokens_drafted_total 700.0
vllm_av:draft_tokens_verified_total 500.0
vllm_av:draft_tokens_accepted_total 200.0
vllm_av:draft_tokens_trimmed_total 200.0
vllm_av:budget 12.0
vllm_av:depth_steps_total 50.0
vllm_av:zero_depth_steps_total 10.0
vllm_av:depth_chosen_steps_total{depth="0"} 10.0
vllm_av:depth_chosen_steps_total{depth="1"} 30.0
vllm_av:depth_chosen_steps_total{depth="7"} 10.0
vllm_av:drafter_catch_up_tokens_total 100.0
vllm_av:draft_depth 7.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""
SCRAPE_AFTER = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 1300.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 600.0
vllm_av:draft_tokens_drafted_total 2100.0
vllm_av:draft_tokens_verified_total 1300.0
vllm_av:draft_tokens_accepted_total 600.0
vllm_av:draft_tokens_trimmed_total 800.0
vllm_av:budget 40.0
vllm_av:depth_steps_total 150.0
vllm_av:zero_depth_steps_total 70.0
vllm_av:depth_chosen_steps_total{depth="0"} 70.0
vllm_av:depth_chosen_steps_total{depth="1"} 50.0
vllm_av:depth_chosen_steps_total{depth="7"} 30.0
vllm_av:drafter_catch_up_tokens_total 350.0
vllm_av:draft_depth 0.0
vllm_av:draft_cost_scale{depth="1"} 4.5
vllm_av:draft_cost_scale{depth="7"} 11.0
vllm_av:prefill_step_cost_scale{tokens_log2="9"} 1.8
vllm_av:prefill_step_cost_scale{tokens_log2="4"} 1.1
"""


def fake_result(arm: str, c: int, thr: float, tpot_ms: float, pass_name: str = "t1",
                with_metrics: bool = False) -> dict:
    a = sweep.make_arm(arm)
    before = sweep.parse_prometheus(SCRAPE_BEFORE) if with_metrics else {}
    after = sweep.parse_prometheus(SCRAPE_AFTER) if with_metrics else {}
    return {
        "completed": 2 * c, "failed": 0, "num_prompts": 2 * c, "duration": 10.0,
        "output_throughput": thr, "total_output_tokens": thr * 10, "mean_tpot_ms": tpot_ms,
        "mean_ttft_ms": 50.0, "output_lens": [100, 200], "latencies": [1.0, 4.0],
        "sweep": {"arm": arm, "concurrency": c, "pass": pass_name, "family": a.family,
                  "role": a.role, "k": a.k, "metrics_delta": sweep.metrics_delta(before, after)},
    }


def write(run_dir: Path, result: dict) -> None:
    s = result["sweep"]
    (run_dir / sweep.result_name(s["arm"], s["concurrency"], s["pass"])).write_text(
        json.dumps(result))


@pytest.fixture
def run_dir(tmp_path):
    # (arm, concurrency) -> (output tok/s, mean TPOT ms); at C=1 k3 has the best
    # throughput and k1 the best per-user speed, so best-fixed differs per metric.
    table = {
        ("nospec", 1): (100, 10.0), ("k1", 1): (150, 6.0), ("k3", 1): (180, 6.5),
        ("vllm_av", 1): (170, 7.0), ("ours", 1): (200, 5.0),
        ("nospec", 16): (1000, 16.0), ("k1", 16): (1200, 13.0), ("k3", 16): (1100, 14.0),
        ("vllm_av", 16): (1250, 12.5), ("ours", 16): (1150, 13.5),
    }
    for (arm, c), (thr, tpot) in table.items():
        write(tmp_path, fake_result(arm, c, thr, tpot, with_metrics=arm == "ours"))
    return tmp_path


def test_arms_build_the_documented_speculative_configs():
    assert sweep.make_arm("nospec").speculative_config("D") is None
    assert sweep.make_arm("k5").speculative_config("D") == {
        "method": "draft_model", "model": "D", "num_speculative_tokens": 5}
    ours = sweep.make_arm("ours")
    assert ours.speculative_config("D")["enable_adaptive_verification"] is True
    assert dict(ours.env) == {"VLLM_AV_IMPL": "ours", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert dict(sweep.make_arm("vllm_av", device="gpu").env) == {
        "VLLM_AV_IMPL": "vllm", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert sweep.make_arm("ngram_k3").speculative_config("D") == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
    ngram_ours = sweep.make_arm("ngram_ours", av_k=5).speculative_config("D")
    assert ngram_ours["num_speculative_tokens"] == 5 and ngram_ours["enable_adaptive_verification"]
    assert dict(sweep.make_arm("ours_v2").env) == {"VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1",
                                                   "VLLM_AV_DRAFTER_GRAPHS": "0"}
    # ngram on Model Runner V2: ours through MRV2NgramAVPatch, no drafter graphs.
    ngram_v2 = sweep.make_arm("ngram_ours_v2")
    assert ngram_v2.role == "ours" and ngram_v2.family == "ngram"
    assert dict(ngram_v2.env) == {"VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1"}
    assert ngram_v2.speculative_config("D")["enable_adaptive_verification"] is True
    with pytest.raises(ValueError, match="ngram_ours_v2"):
        sweep.make_arm("ngram_ours_v2g")
    # The V2 drafter in our FULL graphs: fixed K without AV, and ours.
    graphs_env = {"VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1", "VLLM_AV_DRAFTER_GRAPHS": "1"}
    k3g = sweep.make_arm("k3g")
    assert k3g.role == "fixed" and dict(k3g.env) == graphs_env
    assert k3g.speculative_config("D") == sweep.make_arm("k3").speculative_config("D")
    ours_v2g = sweep.make_arm("ours_v2g")
    assert ours_v2g.role == "ours" and dict(ours_v2g.env) == graphs_env
    assert dict(sweep.make_arm("ours_v2g_keepkv").env) == {
        **graphs_env, "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "0"}
    assert dict(sweep.make_arm("ours_v2g_keepkv_cal").env) == {
        **graphs_env, "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "0",
        "VLLM_AV_STEP_PERIOD_CALIBRATION": "1"}
    assert dict(sweep.make_arm("ours_v2g_cal").env) == {
        **graphs_env, "VLLM_AV_STEP_PERIOD_CALIBRATION": "1"}
    assert dict(sweep.make_arm("ours_v2g_ugraphs_skipmeta").env) == {
        **graphs_env, "VLLM_AV_UNIFORM_DECODE_GRAPHS": "1",
        "VLLM_AV_SKIP_DRAFT_LAYER_METADATA": "1"}
    # Depth 0 on every step, with the options: plain decoding through our V2 path.
    assert dict(sweep.make_arm("ours_v2g_ugraphs_skipmeta_d0").env) == {
        **graphs_env, "VLLM_AV_UNIFORM_DECODE_GRAPHS": "1",
        "VLLM_AV_SKIP_DRAFT_LAYER_METADATA": "1", "VLLM_AV_TEST_FIXED_DEPTH": "0"}
    assert dict(sweep.make_arm("ours_v2g_fullmeta").env) == {
        **graphs_env, "VLLM_AV_SKIP_DRAFT_LAYER_METADATA": "0"}
    assert dict(sweep.make_arm("ours_async_skipmeta").env)[
        "VLLM_AV_SKIP_DRAFT_LAYER_METADATA_V1"] == "1"
    assert dict(sweep.make_arm("ours_v2g_ctx1k").env) == {
        **graphs_env, "VLLM_AV_PROFILE_CONTEXT_LEN": "1024"}
    assert dict(sweep.make_arm("ngram_ours_v2_ugraphs").env) == {
        "VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1", "VLLM_AV_UNIFORM_DECODE_GRAPHS": "1"}
    assert dict(sweep.make_arm("ngram_ours_v2_cal").env) == {
        "VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1", "VLLM_AV_STEP_PERIOD_CALIBRATION": "1"}
    with pytest.raises(ValueError, match="unknown arm"):
        sweep.make_arm("ngram_ours_v2_keepkv")  # no drafter KV to keep
    with pytest.raises(ValueError, match="unknown arm"):
        sweep.make_arm("ours_v2g_nosuch")
    # Ours as served: the flag and nothing else, in either family.
    for name, family in (("ours_served", "draft"), ("ngram_ours_served", "ngram")):
        served = sweep.make_arm(name)
        assert (served.role, served.family, served.env, served.args) == ("ours", family, (), ())
        assert served.speculative_config("D")["enable_adaptive_verification"] is True
    # GPU baselines run plain vLLM (plugin off); CPU ones keep the plugin's
    # sampling fix.
    assert dict(sweep.make_arm("k3", baselines_on_v1=True).env) == {
        "VLLM_AV_IMPL": "off", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert dict(sweep.make_arm("k3", device="cpu").env) == {}
    assert dict(sweep.make_arm("k7v1", device="cpu").env) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    v1_plain = sweep.make_arm("nospecv1")
    assert v1_plain.speculative_config("D") is None and v1_plain.role == "nospec_v1"
    assert dict(v1_plain.env) == {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_AV_IMPL": "off"}
    v1_sync = sweep.make_arm("nospecv1sync")
    assert v1_sync.speculative_config("D") is None and v1_sync.role == "nospec_v1_sync"
    assert v1_sync.args == ("--no-async-scheduling",) and dict(v1_sync.env) == dict(v1_plain.env)
    ours_async = sweep.make_arm("ours_async")
    assert ours_async.role == "ours" and ours_async.args == ("--async-scheduling",)
    assert ours_async.speculative_config("D") == ours.speculative_config("D")
    with pytest.raises(ValueError, match="unknown arm"):
        sweep.make_arm("k")


def test_prompts_interleave_files_and_pick_the_field_per_backend(tmp_path):
    mt = tmp_path / "mt.jsonl"
    he = tmp_path / "he.jsonl"
    mt.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}],
                                        "prompt": f"<t>q{i}</t>"}) for i in range(3)))
    he.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    assert sweep.load_prompts([mt, he], "openai-chat") == ["q0", "def f():", "q1", "q2"]
    assert sweep.load_prompts([mt, he], "openai") == ["<t>q0</t>", "def f():", "<t>q1</t>",
                                                      "<t>q2</t>"]


def test_prompt_file_cycles_so_every_run_sees_a_prefix_of_one_sequence(tmp_path):
    path = tmp_path / "p.json"
    sweep.write_prompt_file(["a", "b", "c"], 7, path)
    rows = json.loads(path.read_text())
    assert [r["conversations"][0]["value"] for r in rows] == list("abcabca")
    assert all(len(r["conversations"]) == 2 for r in rows)  # the ShareGPT loader needs 2 turns


def test_num_prompts_is_two_waves_but_at_least_the_minimum():
    assert sweep.num_prompts_for(1) == sweep.MIN_PROMPTS
    assert sweep.num_prompts_for(128) == 256
    assert sweep.num_prompts_for(128, override=10) == 10
    assert sweep.num_prompts_for(128, waves=4) == 512
    assert sweep.num_prompts_for(1, min_prompts=8, waves=4) == 8


def test_waves_enter_the_fingerprint_only_when_set():
    """Runs made before --waves keep their fingerprint (they resume and
    combine); a run with other waves is not comparable with them."""
    default = sweep.parse_args(["run", "--arms", "ours", "--device", "cpu"])
    four = sweep.parse_args(["run", "--arms", "ours", "--device", "cpu", "--waves", "4"])
    assert "waves" not in sweep._fingerprint(default, ["p"])
    assert sweep._fingerprint(four, ["p"])["waves"] == 4


def test_resume_skips_pairs_whose_json_exists_and_parses(tmp_path):
    write(tmp_path, fake_result("nospec", 1, 100, 10))
    write(tmp_path, fake_result("ours", 1, 100, 10, pass_name="greedy"))
    (tmp_path / sweep.result_name("ours", 16)).write_text("{truncated")  # killed mid-write
    todo = sweep.pending(tmp_path, ["nospec", "ours"], [1, 16], ["t1", "greedy"])
    assert todo == {"nospec": [(1, "greedy"), (16, "t1"), (16, "greedy")],
                    "ours": [(1, "t1"), (16, "t1"), (16, "greedy")]}
    assert sweep.pending(tmp_path, ["nospec"], [1], ["t1"]) == {}


def test_result_names_round_trip_including_arm_names_with_underscores():
    for arm, c, p in [("ngram_k3", 64, "t1"), ("vllm_av", 1, "greedy")]:
        assert sweep.parse_result_name(sweep.result_name(arm, c, p)) == (arm, c, p)
    assert sweep.parse_result_name("summary.json") is None


def test_metrics_delta_subtracts_counters_keeps_gauges_and_drops_created():
    before = sweep.parse_prometheus(SCRAPE_BEFORE)
    assert not any("_created" in k for k in before)
    assert "vllm:num_requests_running" not in " ".join(before)  # not a kept prefix
    m = sweep.spec_metrics(sweep.metrics_delta(before, sweep.parse_prometheus(SCRAPE_AFTER)))
    assert m["sd_draft_tokens"] == 800 and m["sd_accepted_tokens"] == 400
    assert m["sd_acceptance_rate"] == pytest.approx(0.5)
    assert m["sd_mean_acceptance_length"] == pytest.approx(1 + 400 / 200)
    assert m["av_drafted"] == 1400 and m["av_trimmed"] == 600
    assert m["av_verified_fraction"] == pytest.approx(800 / 1400)
    assert m["av_budget"] == 40.0
    # This run's share of depth-0 steps: 60 of its 100 steps.
    assert m["av_zero_depth_share"] == pytest.approx(0.6)
    # This run's steps: 60 at depth 0, 20 at depth 1, 20 at depth 7.
    assert m["av_mean_depth"] == pytest.approx((20 * 1 + 20 * 7) / 100)
    assert m["av_draft_cost_scale"] == 11.0  # a gauge: its value after, worst depth
    assert m["av_prefill_step_scale"] == 1.8  # likewise, worst token bucket
    assert m["av_catch_up_tokens"] == 250  # a counter: this run's share


def test_merge_rows_carry_throughput_per_user_speed_and_av_counters(run_dir):
    summary = sweep.merge(run_dir)
    assert (run_dir / "summary.json").is_file()
    rows = {(r["arm"], r["concurrency"]): r for r in summary["rows"]}
    assert len(rows) == 10
    ours = rows["ours", 1]
    assert ours["tps_user"] == pytest.approx(200.0)  # 1000 / 5 ms
    assert ours["tps_user_e2e"] == pytest.approx((100 / 1 + 200 / 4) / 2)
    assert ours["sd_acceptance_rate"] == pytest.approx(0.5)
    assert rows["nospec", 1]["sd_acceptance_rate"] is None


def test_ratios_use_the_best_fixed_k_per_metric(run_dir):
    r = sweep.merge(run_dir, write=False)["ratios"]["t1"]
    at1 = r["1"]
    assert at1["ours/best_fixed"]["output_throughput"] == {"value": pytest.approx(200 / 180),
                                                          "arm": "k3"}
    assert at1["ours/best_fixed"]["tps_user"]["arm"] == "k1"
    assert at1["ours/best_fixed"]["tps_user"]["value"] == pytest.approx(200 / (1000 / 6))
    assert at1["ours/vllm_av"]["output_throughput"]["value"] == pytest.approx(200 / 170)
    assert at1["ours/nospec"]["output_throughput"]["value"] == pytest.approx(2.0)
    assert at1["pareto"] == ["ours"] and at1["ours_on_pareto"]
    at16 = r["16"]
    # vllm_av beats ours in both at C=16, so ours is off the frontier there.
    assert at16["ours/vllm_av"]["output_throughput"]["value"] == pytest.approx(1150 / 1250)
    assert at16["pareto"] == ["vllm_av"] and not at16["ours_on_pareto"]


def test_ngram_family_compares_within_itself_and_falls_back_to_nospec(tmp_path):
    for arm, thr, tpot in [("nospec", 100, 10), ("ngram_k3", 120, 9), ("ngram_k7", 110, 8),
                           ("ngram_ours", 130, 8), ("ngram_ours_v2", 140, 8)]:
        write(tmp_path, fake_result(arm, 4, thr, tpot))
    e = sweep.merge(tmp_path, write=False)["ratios"]["t1"]["4"]
    assert e["ngram_ours/best_fixed"]["output_throughput"]["arm"] == "ngram_k3"
    # Ours on each runner gets its own ratios against the same baselines.
    assert e["ngram_ours_v2/best_fixed"]["output_throughput"]["value"] == pytest.approx(140 / 120)
    assert e["ngram_ours_v2/nospec"]["output_throughput"]["value"] == pytest.approx(1.4)
    assert e["ngram_ours/best_fixed"]["tps_user"]["arm"] == "ngram_k7"
    assert e["ngram_ours/nospec"]["output_throughput"]["value"] == pytest.approx(1.3)
    assert "ngram_ours/vllm_av" not in e
    assert "ngram_ours/nospecv1" not in e  # no V1 baseline ran


def test_ours_is_also_compared_with_no_speculation_on_its_own_runner(tmp_path):
    for arm, thr, tpot in [("nospec", 100, 10), ("nospecv1", 80, 12), ("ours", 90, 11),
                           ("ngram_ours", 95, 10)]:
        write(tmp_path, fake_result(arm, 4, thr, tpot))
    e = sweep.merge(tmp_path, write=False)["ratios"]["t1"]["4"]
    assert e["ours/nospec"]["output_throughput"]["value"] == pytest.approx(0.9)
    assert e["ours/nospecv1"]["output_throughput"] == {"value": pytest.approx(90 / 80),
                                                      "arm": "nospecv1"}
    # The ngram family borrows the draft family's V1 baseline, as for nospec.
    assert e["ngram_ours/nospecv1"]["output_throughput"]["value"] == pytest.approx(95 / 80)
    # nospecv1 is a baseline, not a contender: the frontier is by the numbers.
    assert e["pareto"] == ["nospec"]
    assert "ours/nospecv1sync" not in e  # that arm did not run


def test_every_ours_arm_gets_its_ratios(tmp_path):
    for arm, thr, tpot in [("nospecv1", 80, 12), ("ours", 60, 15), ("ours_async", 88, 11)]:
        write(tmp_path, fake_result(arm, 4, thr, tpot))
    e = sweep.merge(tmp_path, write=False)["ratios"]["t1"]["4"]
    assert e["ours/nospecv1"]["output_throughput"]["value"] == pytest.approx(60 / 80)
    assert e["ours_async/nospecv1"]["output_throughput"]["value"] == pytest.approx(88 / 80)
    assert e["ours_async_on_pareto"] and not e["ours_on_pareto"]


def test_ours_against_plain_v1_with_synchronous_scheduling(tmp_path):
    for arm, thr, tpot in [("nospecv1", 80, 12), ("nospecv1sync", 60, 15), ("ours", 66, 14)]:
        write(tmp_path, fake_result(arm, 4, thr, tpot))
    e = sweep.merge(tmp_path, write=False)["ratios"]["t1"]["4"]
    assert e["ours/nospecv1sync"]["output_throughput"] == {"value": pytest.approx(1.1),
                                                          "arm": "nospecv1sync"}
    assert e["ours/nospecv1"]["output_throughput"]["value"] == pytest.approx(66 / 80)


def test_parts_merge_and_passes_stay_apart(run_dir):
    # A second part of the sweep (another concurrency, a greedy pass) lands
    # in the same folder; merge takes everything, keyed by pass.
    write(run_dir, fake_result("ours", 64, 5000, 30))
    write(run_dir, fake_result("ours", 1, 210, 4.8, pass_name="greedy"))
    write(run_dir, fake_result("nospec", 1, 105, 9.5, pass_name="greedy"))
    s = sweep.merge(run_dir, write=False)
    assert set(s["ratios"]) == {"t1", "greedy"}
    assert s["ratios"]["greedy"]["1"]["ours/nospec"]["output_throughput"]["value"] == \
        pytest.approx(2.0)
    assert "ours/best_fixed" not in s["ratios"]["greedy"]["1"]  # no fixed K in that pass
    assert "64" in s["ratios"]["t1"]


def test_report_prints_tables_and_failures(run_dir):
    (run_dir / "failed").mkdir()
    (run_dir / "failed" / "k7.json").write_text(json.dumps(
        {"arm": "k7", "concurrency": None, "reason": "no /health after 10 s"}))
    text = sweep.report_markdown(sweep.merge(run_dir, write=False))
    assert "| C | nospec | k1 | k3 | vllm_av | ours |" in text
    assert "ours/best_fixed" in text and "[k3/k1]" in text
    assert "k7 c=None: no /health" in text


def test_module_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None; sys.path.insert(0, %r); "
            "import benchmarks.sweep") % str(REPO)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dry_run_lists_commands_without_starting_servers(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    rc = sweep.main(["run", "--run-name", "x", "--results-root", str(tmp_path),
                     "--arms", "nospec,ours,nospecv1sync", "--concurrency", "1",
                     "--prompts", str(prompts),
                     "--target", "/m/t", "--draft", "/m/d", "--device", "cpu", "--dry-run",
                     "--server-args", "--max-model-len 256"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--kv-cache-memory-bytes 268435456 --max-model-len 256" in out
    assert '"enable_adaptive_verification": true' in out
    assert "--max-model-len 256 --no-async-scheduling" in out  # the arm's own args last


def test_compact_drops_per_token_lists_but_keeps_every_merged_figure(run_dir):
    for path in run_dir.glob("*_c*.json"):
        data = json.loads(path.read_text())
        data.update(itls=[[0.01] * 50] * 4, generated_texts=["x" * 500] * 4, ttfts=[0.1] * 4,
                    output_lens=[10, 20, 30, 40], latencies=[1.0, 2.0, 3.0, 4.0])
        path.write_text(json.dumps(data))
    before = sweep.merge(run_dir, write=False)["rows"]
    assert sweep.compact(run_dir) > 0
    after = sweep.merge(run_dir, write=False)["rows"]
    assert after == before
    for path in run_dir.glob("*_c*.json"):
        data = json.loads(path.read_text())
        assert not any(k in data for k in sweep.BULKY_FIELDS)
        assert data["output_lens"] == [10, 20, 30, 40]  # what tps_user_e2e reads stays
    assert sweep.compact(run_dir) == 0  # nothing left to drop


def test_a_mistyped_quiet_start_role_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        sweep.parse_args(["run", "--arms", "ours", "--quiet-start", "ourz"])
    assert sweep.parse_args(["run", "--arms", "ours", "--quiet-start", "none"]).quiet_start == ["none"]


def test_each_arm_writes_its_own_cost_table(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_AV_COST_TABLE_OUT", str(tmp_path / "cost.json"))
    opts = sweep.parse_args(["run", "--arms", "ours", "--device", "cpu"])
    env = sweep.Server(opts, sweep.make_arm("ours_async"), tmp_path / "log").env()
    assert env["VLLM_AV_COST_TABLE_OUT"] == str(tmp_path / "cost_ours_async.json")


def test_spread_compares_the_cells_every_folder_holds(tmp_path):
    a, b = tmp_path / "round_a" / "sweep", tmp_path / "round_b" / "sweep"
    for d in (a, b):
        d.mkdir(parents=True)
    for arm, c, thr_a, thr_b in (("nospec", 1, 100, 120), ("nospec", 16, 1000, 800),
                                 ("ours", 1, 90, 90)):
        write(a, fake_result(arm, c, thr_a, 10.0))
        write(b, fake_result(arm, c, thr_b, 10.0))
    write(a, fake_result("k3", 1, 50, 10.0))  # in one folder only: left out
    write(b, fake_result("ours", 16, 5, 10.0, pass_name="t0"))  # greedy pass: left out
    text, ratio = sweep.spread([a, b])
    assert ratio == pytest.approx({("nospec", 1): 1.2, ("nospec", 16): 1.25, ("ours", 1): 1.0})
    assert "round_a/sweep | round_b/sweep" in text and "| nospec | 16 | 1,000 | 800 | 1.25 |" in text
    assert "3 cells in every folder; max / min: median 1.20, largest 1.25" in text


def _part(root: Path, name: str, fingerprint: dict, results) -> Path:
    d = root / name
    d.mkdir()
    (d / "sweep_config.json").write_text(json.dumps({"fingerprint": fingerprint}))
    (d / "prompts.json").write_text(json.dumps(["p0", "p1"]))
    for r in results:
        write(d, r)
    return d


def test_combine_merges_parts_run_apart_into_one_report(tmp_path):
    # Two GPUs, each with some arms: ours' ratios need arms of both parts.
    fp = {"output_len": 512, "temperature": 1.0}
    a = _part(tmp_path, "a", fp, [fake_result("ours", 1, 200, 5.0), fake_result("nospec", 1, 100, 10.0)])
    b = _part(tmp_path, "b", fp, [fake_result("k3", 1, 180, 6.5), fake_result("vllm_av", 1, 50, 20.0)])
    record = sweep.combine(tmp_path / "all", [a, b])
    assert record["results"] == {"ours_c1.json": str(a), "nospec_c1.json": str(a),
                                 "k3_c1.json": str(b), "vllm_av_c1.json": str(b)}
    entry = sweep.merge(tmp_path / "all", write=False)["ratios"]["t1"]["1"]
    assert entry["ours/best_fixed"]["output_throughput"] == {"value": pytest.approx(200 / 180),
                                                             "arm": "k3"}
    assert entry["ours/vllm_av"]["output_throughput"]["value"] == pytest.approx(4.0)
    assert entry["ours/nospec"]["output_throughput"]["value"] == pytest.approx(2.0)
    assert json.loads((tmp_path / "all" / "combined.json").read_text())["parts"] == [str(a), str(b)]


def test_combine_refuses_parts_of_other_settings_or_the_same_cell_twice(tmp_path):
    a = _part(tmp_path, "a", {"output_len": 512}, [fake_result("ours", 1, 200, 5.0)])
    b = _part(tmp_path, "b", {"output_len": 256}, [fake_result("k3", 1, 180, 6.5)])
    with pytest.raises(ValueError, match="other settings.*output_len"):
        sweep.combine(tmp_path / "x", [a, b])
    c = _part(tmp_path, "c", {"output_len": 512}, [fake_result("ours", 1, 150, 6.0)])
    with pytest.raises(ValueError, match="ours_c1.json is in both"):
        sweep.combine(tmp_path / "y", [a, c])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    with pytest.raises(ValueError, match="not a sweep folder"):
        sweep.combine(tmp_path / "z", [a, tmp_path])


def test_greedy_only_runs_the_temperature_0_pass_alone(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    args = ["run", "--run-name", "x", "--results-root", str(tmp_path), "--arms", "nospec",
            "--concurrency", "1,16", "--prompts", str(prompts), "--target", "/m/t",
            "--draft", "/m/d", "--device", "cpu", "--dry-run"]
    assert sweep.main(args + ["--greedy-only"]) == 0
    assert "nospec: [(1, 'greedy'), (16, 'greedy')]" in capsys.readouterr().out
    assert sweep.main(args + ["--greedy"]) == 0  # control: both passes
    assert "nospec: [(1, 't1'), (1, 'greedy'), (16, 't1'), (16, 'greedy')]" in capsys.readouterr().out


class _FakeServer(sweep.Server):
    """A server that starts at once, scrapes empty /metrics and, asked to
    write a cost table, writes one."""

    started: list = []

    def spawn(self):
        self.proc = object()
        _FakeServer.started.append((self.arm.name, dict(self.extra_env)))
        out = self.env().get("VLLM_AV_COST_TABLE_OUT")
        if out:
            Path(out).write_text("{}")

    def wait_healthy(self):
        pass

    def start(self):
        self.spawn()

    def scrape(self):
        return {}, ""

    def stop(self):
        self.proc = None


def _bench_order(tmp_path, monkeypatch, extra: list[str],
                 arms: tuple[str, ...] = ("nospec", "k1")) -> list[tuple[str, int]]:
    """Runs a two-arm, two-concurrency sweep against fake servers; the
    (arm, C) order of its benchmarks, warm-ups left out."""
    calls = []

    def fake_bench(opts, server, prompt_file, c, n, temp, log_path, out_dir=None,
                   filename=None):
        if filename is None:
            return  # a warm-up
        calls.append((server.arm.name, c))
        (out_dir / filename).write_text(json.dumps(
            {"completed": n, "failed": 0, "output_throughput": 10.0 * c, "mean_tpot_ms": 5.0}))

    _FakeServer.started = []
    monkeypatch.setattr(sweep, "Server", _FakeServer)
    monkeypatch.setattr(sweep, "_bench", fake_bench)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    rc = sweep.main(["run", "--run-name", "x", "--results-root", str(tmp_path),
                     "--arms", ",".join(arms), "--concurrency", "1,16", "--prompts", str(prompts),
                     "--target", "/m/t", "--draft", "/m/d", "--device", "cpu",
                     "--metrics-settle-s", "0", "--parallel-start", *extra])
    assert rc == 0
    for a in arms:
        for c in (1, 16):
            assert sweep.is_done(tmp_path / "x", a, c), (a, c)
    return calls


def test_arms_run_one_after_another_by_default(tmp_path, monkeypatch):
    assert _bench_order(tmp_path, monkeypatch, []) == [
        ("nospec", 1), ("nospec", 16), ("k1", 1), ("k1", 16)]


def test_interleave_benches_each_concurrency_over_every_arm_in_turn(tmp_path, monkeypatch):
    assert _bench_order(tmp_path, monkeypatch, ["--interleave"]) == [
        ("nospec", 1), ("k1", 1), ("nospec", 16), ("k1", 16)]


def test_a_shared_cost_table_is_profiled_alone_then_loaded_by_the_familys_other_ours_arms(
        tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_AV_COST_TABLE_OUT", raising=False)
    arms = ("nospec", "ours_served", "ngram_ours_served", "ours_v2g_d0")
    _bench_order(tmp_path, monkeypatch, ["--shared-cost-table", "--quiet-start", "none"], arms)
    started = dict(_FakeServer.started)
    # Each family's first ours arm starts alone, first, writing its table.
    assert [n for n, _ in _FakeServer.started[:2]] == ["ours_served", "ngram_ours_served"]
    table = str(tmp_path / "x" / "logs" / "cost_table_ours_served.json")
    assert Path(table).is_file()
    # Its family's other ours arm loads it; other families and roles do not.
    assert started["ours_v2g_d0"] == {"VLLM_AV_COST_TABLE": table}
    assert "VLLM_AV_COST_TABLE" not in started["ngram_ours_served"]
    assert started["nospec"] == {}
    result = json.loads((tmp_path / "x" / sweep.result_name("ours_v2g_d0", 1)).read_text())
    assert result["sweep"]["env"]["VLLM_AV_COST_TABLE"] == table


def test_without_a_shared_cost_table_every_ours_arm_profiles_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_AV_COST_TABLE_OUT", raising=False)
    _bench_order(tmp_path, monkeypatch, ["--quiet-start", "none"], ("ours_served", "ours_v2g_d0"))
    assert all(env == {} for _, env in _FakeServer.started)
