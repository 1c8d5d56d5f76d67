"""Step timings under async scheduling, read without stalling the pipeline.

The synchronous path corrects its cost tables from timed steps with a
device synchronize on each side (`_StepTimer`, `_DraftTimer` in
patches.py). Under async scheduling a synchronize would serialise the CPU
with the GPU, which is what async scheduling exists to avoid, so there the
step is bracketed by device events instead: one when the step starts
(`_update_states`), one before drafting, one after. The events are read a
step or more later, once the last has completed (`Event.query`, which never
blocks), and the two intervals correct the verification and drafting tables
as the synchronous timers do. The interval between two events includes any
time the GPU sat idle waiting for the host, which is a real cost of the
step. Without CUDA (the CPU backend) the marks are host times: execution
there is synchronous, so they time the same thing.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

# Time one step in this many of each kind, as the synchronous timers do.
TIMING_INTERVAL = 4
# Pending measurements kept at most (older ones are dropped unread).
MAX_PENDING = 8


class _HostMark:
    def __init__(self):
        self.t = time.perf_counter()

    def ready(self) -> bool:
        return True

    def ms_since(self, earlier: "_HostMark") -> float:
        return (self.t - earlier.t) * 1e3


class _DeviceMark:
    def __init__(self):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def ready(self) -> bool:
        return self.event.query()

    def ms_since(self, earlier: "_DeviceMark") -> float:
        return earlier.event.elapsed_time(self.event)


def timing_due(last_timed: dict, kind, step: int, interval: int = TIMING_INTERVAL) -> bool:
    """Whether to time step `step` of `kind`: `interval` steps after the
    last timed one of that kind (recorded in `last_timed`). A kind that runs
    every step is timed every `interval`-th step; a rare one (the drafting
    steps of exploration, with depth 0 elsewhere) each time it runs, so its
    correction does not wait for dozens of occurrences."""
    if step - last_timed.get(kind, 0) < interval:
        return False
    last_timed[kind] = step
    return True


def answer(flag) -> bool:
    """A flag given as a bool or as a callable that computes it (asked only
    where needed: for a timed step)."""
    return bool(flag() if callable(flag) else flag)


def mark(device):
    """A timestamp on `device`'s stream (CUDA) or on the host (otherwise)."""
    if device is not None and torch.device(device).type == "cuda":
        return _DeviceMark()
    return _HostMark()


@dataclass
class _Step:
    start: object
    num_tokens: int
    mid: object = None
    end: object = None
    depth: int = 0
    num_drafting: int = 0
    plain: bool = False  # the step verifies no draft
    prefill: bool = False  # the step carries prompt tokens


class AsyncStepClock:
    """Marks a step every TIMING_INTERVAL steps, plain steps and speculative
    ones paced apart (`timing_due`); `collect` hands finished measurements
    to the verifier."""

    def __init__(self, device):
        self.device = device
        self.steps = 0
        self.current: _Step | None = None
        self.pending: deque[_Step] = deque(maxlen=MAX_PENDING)
        self.last_timed: dict = {}  # plain (bool) -> the step last timed

    @property
    def timing(self) -> bool:
        """Whether the current step is one being timed."""
        return self.current is not None

    def step_started(self, num_tokens: int, plain: bool = False, prefill=False) -> None:
        """`prefill`: a bool, or a callable giving it (asked only for a
        timed step)."""
        self.steps += 1
        self.current = None
        if num_tokens > 0 and timing_due(self.last_timed, plain, self.steps):
            self.current = _Step(mark(self.device), int(num_tokens), plain=plain,
                                 prefill=answer(prefill))

    def drafting_starts(self) -> None:
        if self.current is not None:
            self.current.mid = mark(self.device)

    def drafting_done(self, depth: int, num_drafting: int) -> None:
        step, self.current = self.current, None
        if step is None or step.mid is None:
            return
        step.end = mark(self.device)
        step.depth, step.num_drafting = int(depth), int(num_drafting)
        self.pending.append(step)

    def collect(self, verifier) -> int:
        """Observe every pending step whose last mark has completed, oldest
        first; returns how many were observed."""
        n = 0
        while self.pending and self.pending[0].end.ready():
            step = self.pending.popleft()
            verifier.observe_verify_time(step.num_tokens, step.mid.ms_since(step.start),
                                         plain=step.plain, prefill=step.prefill)
            if step.depth > 0 and step.num_drafting > 0:
                verifier.observe_draft_time(
                    step.depth, step.num_drafting, step.end.ms_since(step.mid)
                )
            n += 1
        return n
