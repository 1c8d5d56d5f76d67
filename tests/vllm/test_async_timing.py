"""Cost calibration under async scheduling: steps bracketed by marks read
later, never by a synchronize (vllm_av/vllm/mrv1/async_timing.py)."""

from __future__ import annotations

import pytest

from vllm_av.vllm.mrv1 import async_timing
from vllm_av.vllm.mrv1.async_timing import TIMING_INTERVAL, AsyncStepClock


class _Verifier:
    def __init__(self):
        self.verify, self.draft, self.plain, self.prefill = [], [], [], []

    def observe_verify_time(self, num_tokens, ms, plain=False, prefill=False):
        self.verify.append((num_tokens, round(ms, 6)))
        self.plain.append(plain)
        self.prefill.append(prefill)

    def observe_draft_time(self, depth, num_reqs, ms):
        self.draft.append((depth, num_reqs, round(ms, 6)))


class _Mark:
    """A mark at a scripted time that completes when the test says so."""

    now = 0.0
    done = True

    def __init__(self):
        self.t, self.cls = _Mark.now, _Mark

    def ready(self):
        return self.cls.done

    def ms_since(self, earlier):
        return self.t - earlier.t


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(async_timing, "mark", lambda device: _Mark())
    _Mark.now, _Mark.done = 0.0, True
    return AsyncStepClock(device=None)


def _step(clock, tokens, forward_ms, depth, draft_ms, reqs=4, plain=False):
    clock.step_started(tokens, plain=plain)
    _Mark.now += forward_ms
    clock.drafting_starts()
    _Mark.now += draft_ms
    clock.drafting_done(depth, reqs)


def test_every_fourth_step_is_timed_into_both_tables(clock):
    v = _Verifier()
    for i in range(2 * TIMING_INTERVAL):
        _step(clock, tokens=10 + i, forward_ms=3.0, depth=i % 3, draft_ms=2.0 * (i % 3))
        clock.collect(v)
    # Steps 4 and 8 (i = 3, 7): depths 0 and 1.
    assert v.verify == [(13, 3.0), (17, 3.0)]
    assert v.draft == [(1, 4, 2.0)]  # a depth-0 step corrects no drafting cost


def test_unfinished_steps_wait_and_are_read_in_order(clock):
    v = _Verifier()
    _Mark.done = False
    for i in range(3 * TIMING_INTERVAL):
        _step(clock, tokens=8, forward_ms=1.0 + i, depth=2, draft_ms=5.0)
    assert clock.collect(v) == 0 and v.verify == []
    _Mark.done = True
    assert clock.collect(v) == 3
    assert [ms for _, ms in v.verify] == [4.0, 8.0, 12.0]
    assert v.draft == [(2, 4, 5.0)] * 3


def test_steps_that_never_drafted_or_scheduled_nothing_are_not_timed(clock):
    v = _Verifier()
    for _ in range(TIMING_INTERVAL):
        clock.step_started(0)  # nothing scheduled
    clock.drafting_starts()
    clock.drafting_done(1, 4)
    clock.step_started(8)  # due, but vLLM skipped the drafter call: no mid mark
    clock.step_started(8)  # not due
    clock.drafting_starts()
    clock.drafting_done(1, 4)
    assert clock.collect(v) == 0


def test_rare_speculative_steps_are_each_timed(clock):
    # Depth 0 nearly everywhere: the drafting steps of exploration are rare,
    # and each is timed (at least TIMING_INTERVAL steps apart), while plain
    # steps keep one in TIMING_INTERVAL.
    v = _Verifier()
    for i in range(1, 6 * TIMING_INTERVAL + 1):
        spec = i % (2 * TIMING_INTERVAL) == 5  # steps 5, 13, 21
        _step(clock, tokens=8, forward_ms=1.0, depth=2 if spec else 0,
              draft_ms=5.0 if spec else 0.0, plain=not spec)
        clock.collect(v)
    assert v.draft == [(2, 4, 5.0)] * 3
    assert v.plain.count(False) == 3 and v.plain.count(True) == 6  # 4, 8, ..., 24


def test_host_marks_measure_host_time():
    a = async_timing.mark(None)
    b = async_timing.mark("cpu")
    assert a.ready() and b.ready() and b.ms_since(a) >= 0.0


def test_a_plain_step_is_timed_into_the_plain_table(clock):
    # A step that verifies no draft runs as plain decoding: its interval
    # corrects the plain verification table (observe_verify_time(plain=True)).
    v = _Verifier()
    for i in range(2 * TIMING_INTERVAL):
        _step(clock, tokens=8, forward_ms=2.0, depth=0, draft_ms=0.0, plain=i < TIMING_INTERVAL)
        clock.collect(v)
    assert v.verify == [(8, 2.0), (8, 2.0)] and v.plain == [True, False]


def test_synchronous_timers_pace_kinds_apart():
    # The synchronous path's timers (vllm_av/vllm/mrv1/patches.py) follow
    # the same rule: each rare drafting step is timed, plain steps one in
    # DRAFT_TIMING_INTERVAL.
    from types import SimpleNamespace

    from vllm_av.vllm.mrv1.patches import DRAFT_TIMING_INTERVAL, _DraftTimer, _StepTimer

    runner = SimpleNamespace(device=None)
    n = DRAFT_TIMING_INTERVAL
    drafting_steps = {n + 1, 3 * n + 1, 5 * n + 1}
    timed_steps, timed_drafts = [], []
    for step in range(1, 6 * n + 1):
        spec = step in drafting_steps
        _StepTimer.start(runner, 8, plain=not spec)
        if getattr(runner, _StepTimer.ATTR) is not None:
            timed_steps.append((step, not spec))
        if spec and _DraftTimer(runner).active:
            timed_drafts.append(step)
    assert timed_drafts == sorted(drafting_steps)
    assert [s for s, plain in timed_steps if not plain] == sorted(drafting_steps)
    assert [s for s, plain in timed_steps if plain] == list(range(n, 6 * n + 1, n))


def test_whether_a_step_carried_prompt_tokens_is_asked_only_when_it_is_timed(clock):
    # The check walks the step's requests, so it runs for timed steps only,
    # and its answer travels with the measurement.
    v, asked = _Verifier(), []

    def prefill(answer):
        def ask():
            asked.append(answer)
            return answer
        return ask

    for i in range(2 * TIMING_INTERVAL):
        clock.step_started(8, prefill=prefill(i < TIMING_INTERVAL))
        clock.drafting_starts()
        clock.drafting_done(1, 4)
        clock.collect(v)
    assert asked == [True, False]  # steps 4 and 8
    assert v.prefill == [True, False]


def test_carries_prefill_counts_tokens_beyond_one_per_request_and_its_drafts():
    from types import SimpleNamespace

    from vllm_av.vllm.mrv1.patches import carries_prefill

    def out(num_scheduled, spec):
        return SimpleNamespace(num_scheduled_tokens=num_scheduled,
                               total_num_scheduled_tokens=sum(num_scheduled.values()),
                               scheduled_spec_decode_tokens=spec)

    assert not carries_prefill(out({"a": 1, "b": 1}, {}))
    assert not carries_prefill(out({"a": 4, "b": 1}, {"a": [7, 8, 9]}))
    assert not carries_prefill(out({"a": 4}, {"a": [-1, -1, -1]}))  # async placeholders
    assert carries_prefill(out({"a": 1, "new": 300}, {}))
    assert carries_prefill(out({"a": 4, "chunk": 64}, {"a": [7, 8, 9]}))
    assert not carries_prefill(out({}, None))
