"""The main job's summary logic (vllm_av/demo.py) on fake data: /metrics
parsing, per-user tokens/s, accepted tokens per step, the table. No server."""

import json

import pytest

from vllm_av import demo

# What vLLM 0.32's /metrics shows for a draft_model server with our AV on
# (trimmed to the lines we read, plus neighbours the parser must skip).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 20.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 100.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 12.0
vllm:num_requests_running{engine="0",model_name="target"} 0.0
# TYPE vllm_av:draft_tokens_drafted_total counter
vllm_av:draft_tokens_drafted_total 140.0
vllm_av:draft_tokens_verified_total 110.0
vllm_av:draft_tokens_accepted_total 50.0
vllm_av:draft_tokens_trimmed_total 30.0
vllm_av:budget 6.0
vllm_av:acceptance_observed{position="1"} 0.5
vllm_av:acceptance_observed{position="0"} 0.9
vllm_av:acceptance_predicted{position="0"} 0.85
vllm_av:acceptance_predicted{position="1"} 0.55
process_cpu_seconds_total 12.0
"""


def test_parse_metrics_keeps_our_and_spec_decode_series_and_drops_the_rest():
    m = demo.parse_metrics(METRICS)
    assert m["vllm:spec_decode_num_drafts_total"] == {(): 20.0}
    assert "vllm:spec_decode_num_drafts_created" not in m
    assert "vllm:num_requests_running" not in m
    assert "process_cpu_seconds_total" not in m
    assert m["vllm_av:acceptance_observed"] == {(("position", "0"),): 0.9, (("position", "1"),): 0.5}


def test_labels_with_escaped_quotes_and_commas_parse():
    text = 'vllm:spec_decode_num_drafts_total{model_name="a\\"b,c",engine="0"} 3.0\n'
    assert demo.parse_metrics(text) == {"vllm:spec_decode_num_drafts_total": {(): 3.0}}


def test_counter_reads_with_or_without_total_suffix_and_defaults_to_zero():
    m = demo.parse_metrics(METRICS)
    assert demo.counter(m, "vllm_av:draft_tokens_drafted") == 140.0
    assert demo.counter(m, "vllm:spec_decode_num_drafts") == 20.0
    assert demo.counter(m, "vllm_av:budget") == 6.0
    assert demo.counter({}, "vllm:spec_decode_num_drafts") == 0.0


def test_acceptance_per_position_is_ordered_by_position_not_by_line():
    acc = demo.av_acceptance(demo.parse_metrics(METRICS))
    assert acc == {"observed": [0.9, 0.5], "predicted": [0.85, 0.55], "budget": 6.0}


def test_accepted_tokens_per_step_is_accepted_over_drafts_plus_one_on_deltas():
    before = demo.parse_metrics(
        "vllm:spec_decode_num_drafts_total 5.0\n"
        "vllm:spec_decode_num_draft_tokens_total 15.0\n"
        "vllm:spec_decode_num_accepted_tokens_total 10.0\n")
    after = demo.parse_metrics(METRICS)
    s = demo.spec_figures("k3", before, after)
    # 15 drafts, 40 accepted: 40/15 + 1 tokens per step.
    assert s["accepted_per_step"] == pytest.approx(40 / 15 + 1)
    assert (s["drafted"], s["verified"], s["accepted"], s["trimmed"]) == (85, 85, 40, 0)


def test_ours_takes_draft_token_counts_from_our_counters():
    s = demo.spec_figures("ours", {}, demo.parse_metrics(METRICS))
    assert (s["drafted"], s["verified"], s["accepted"], s["trimmed"]) == (140, 110, 50, 30)
    assert s["accepted_per_step"] == pytest.approx(50 / 20 + 1)


def test_ours_counts_the_level_s_steps_at_each_drafting_depth_and_the_table_shows_shares():
    depth = ('vllm_av:depth_chosen_steps_total{{depth="0"}} {}\n'
             'vllm_av:depth_chosen_steps_total{{depth="1"}} {}\n'
             'vllm_av:depth_chosen_steps_total{{depth="7"}} {}\n')
    before = demo.parse_metrics(METRICS + depth.format(10.0, 5.0, 2.0))
    after = demo.parse_metrics(METRICS + depth.format(40.0, 5.0, 12.0))
    s = demo.spec_figures("ours", before, after)
    assert s["steps_by_depth"] == {0: 30.0, 1: 0.0, 7: 10.0}
    reqs = [demo.request_timing("humaneval", 65, [1.0, 9.0], 9.0)]
    lv = demo.level_summary("ours", 4, reqs, 9.0, before, after)
    line = [x for x in demo.format_table([lv], {}).splitlines() if "depth" in x]
    assert line == ["ours C=4 steps by drafting depth (40 steps): 0: 75%  7: 25%"]
    json.dumps(lv)
    # No step chose a depth in the level (fixed K, or adaptive depth off).
    assert "steps_by_depth" not in demo.spec_figures("ours", after, after)


def test_no_speculation_has_no_draft_figures():
    s = demo.spec_figures("nospec", {}, {})
    assert s["accepted_per_step"] is None and "drafted" not in s


def test_per_user_rate_counts_tokens_not_chunks_and_excludes_the_first_token():
    # 33 tokens in 5 chunks (speculation delivers several per chunk): the
    # first at 2 s (prefill), the last at 6 s -> 32 tokens in 4 s.
    r = demo.request_timing("humaneval", 33, [2.0, 3.0, 4.0, 5.0, 6.0], 6.1)
    assert r["tok_s_per_user"] == pytest.approx(8.0)
    assert r["ttft_s"] == 2.0 and r["decode_s"] == 4.0


def test_per_user_rate_is_undefined_for_a_single_chunk():
    assert demo.request_timing("mtbench", 1, [0.5], 0.6)["tok_s_per_user"] is None
    assert demo.request_timing("mtbench", 0, [], 0.6)["ttft_s"] == 0.6


def test_level_summary_output_rate_is_all_tokens_over_wall_time():
    reqs = [demo.request_timing("humaneval", 65, [1.0, 9.0], 9.0),
            demo.request_timing("mtbench", 65, [1.0, 5.0], 5.0)]
    lv = demo.level_summary("nospec", 2, reqs, 10.0, {}, {})
    assert lv["output_tok_s"] == pytest.approx(13.0)
    assert lv["tok_s_per_user"] == pytest.approx((8.0 + 16.0) / 2)
    assert lv["mean_ttft_s"] == pytest.approx(1.0)


def test_table_has_a_row_per_level_and_the_observed_acceptance_of_ours():
    m = demo.parse_metrics(METRICS)
    reqs = [demo.request_timing("humaneval", 65, [1.0, 9.0], 9.0)]
    levels = [demo.level_summary("ours", 1, reqs, 9.0, {}, m),
              demo.level_summary("nospec", 1, reqs, 9.0, {}, {})]
    table = demo.format_table(levels, {"ours": demo.av_acceptance(m)})
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["arm", "C", "out"]
    assert lines[2].split() == ["ours", "1", "7.22", "8.00", "3.50", "140", "110", "50", "30"]
    assert lines[3].split() == ["nospec", "1", "7.22", "8.00", "-", "-", "-", "-", "-"]
    assert len(lines[3]) == len(lines[2])  # dashes keep the columns
    assert lines[4].endswith("observed:  0.90 0.50")
    json.dumps(levels)  # the summary file must serialise


def test_prompts_alternate_completion_and_chat(tmp_path):
    (tmp_path / "humaneval.jsonl").write_text(
        json.dumps({"id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    (tmp_path / "mtbench.jsonl").write_text(
        json.dumps({"id": 81, "messages": [{"role": "user", "content": "hi"},
                                           {"role": "user", "content": "turn 2"}]}) + "\n")
    ps = demo.load_prompts(tmp_path, 3)
    assert [p["endpoint"] for p in ps] == ["/v1/completions", "/v1/chat/completions",
                                           "/v1/completions"]
    assert ps[1]["body"] == {"messages": [{"role": "user", "content": "hi"}]}


def test_arms_map_to_speculative_configs():
    assert demo.speculative_config("nospec", "d") is None
    assert demo.speculative_config("k3", "d") == {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 3}
    ours = demo.speculative_config("ours", "d")
    assert ours["num_speculative_tokens"] == 7 and ours["enable_adaptive_verification"]
    cmd = demo.serve_command("vllm", "t", "d", "ours", 8000, 4)
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == ours
    with pytest.raises(ValueError):
        demo.speculative_config("k5", "d")
