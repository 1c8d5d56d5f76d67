"""Drafting depth chosen when a step is scheduled (async scheduling, V1).

With asynchronous scheduling vLLM schedules step t+1 before step t's drafts
exist: the scheduler reserves placeholder draft slots for every request, as
many as the `num_spec_tokens_to_schedule` of step t, and the runner drafts
exactly that many. So the depth must be known at scheduling time, and no
draft can be trimmed after it is made. vLLM 0.32's dynamic speculative
decoding already has the seam: each step the scheduler reads the depth
from `Scheduler.dynamic_sd_lookup[batch size]`. We put an object there that
asks our verifier (`AdaptiveVerifier.choose_depth`: stale scores and
profiled costs, never this step's tokens, so lossless). The verifier lives
on the runner, in the engine-core process under vLLM's single-process
executor (one GPU, or the CPU backend); `register_local_verifier` makes it
findable, and the engine's scheduler claims it when it is built. Under a
multi-process executor none is found and the scheduler keeps vLLM's full
depth (logged once).

Outcomes reach the host a step late under async scheduling: they are read
where vLLM reads them, in the correction closure its `_update_states`
returns (see RunnerForgetPatch in patches.py).
"""

from __future__ import annotations

import logging

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")

# The verifier registered last in this process, and whether a scheduler has
# claimed it. The engine core builds its worker (which registers) before its
# scheduler (which claims), so a scheduler takes the verifier of its own
# engine, and an engine whose verifier is elsewhere (a multi-process
# executor) does not take another in-process engine's.
_LOCAL: dict = {"verifier": None, "claimed": True}


def register_local_verifier(verifier) -> None:
    _LOCAL["verifier"] = verifier
    _LOCAL["claimed"] = verifier is None


def local_verifier():
    """The verifier registered last in this process (claimed or not)."""
    return _LOCAL["verifier"]


def claim_local_verifier():
    """The verifier registered since the last claim, once; else None."""
    if _LOCAL["claimed"]:
        return None
    _LOCAL["claimed"] = True
    return _LOCAL["verifier"]


def scan_running(running) -> tuple[list, bool, bool]:
    """(ids of the requests that decode, whether any of them carries its own
    seed, whether the step holds prompt tokens: a chunk of a long prompt,
    or a new or resumed request whose computed tokens are short of its
    prompt). One pass in Python: a form with map/any measured no faster
    (benchmarks/scan_running_cost.py)."""
    decoding, seeded, prompt = [], False, False
    for r in running:
        prompt = prompt or r.is_prefill_chunk or r.num_computed_tokens < r.num_prompt_tokens
        if not r.is_prefill_chunk:
            decoding.append(r.request_id)
            seeded = seeded or getattr(r.sampling_params, "seed", None) is not None
    return decoding, seeded, prompt


class RequestIds:
    """The ids of a snapshot of requests, read only when iterated: at depth
    0 the policy reads the count alone (`AdaptiveVerifier._best_depth`)."""

    __slots__ = ("requests",)

    def __init__(self, requests: list):
        self.requests = requests

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return (r.request_id for r in self.requests)


class RunningScan:
    """`scan_running`, without the pass over the requests while its answer
    cannot have changed: the last pass found every running request decoding
    and none seeded, and none has joined since. vLLM's scheduler only ever
    adds to `running` by appending, and a step that preempts schedules no
    waiting request, so "the last request is the one seen last and the list
    is no longer" means nothing joined; requests that left change neither
    answer, and a decoding request stays decoding while it runs. At 256
    requests on the CPU the pass costs 69 us, the kept answer 1.5 us
    (benchmarks/scan_running_cost.py).
    Not seen: a running request whose computed tokens a KV connector resets
    after a failed load, or the last request preempted and resumed between
    two looks with no step scheduled in between (back in its place). Its
    recomputed prompt then counts as decoding, which only lets an
    exploration step come early; nothing about which tokens are verified
    depends on it."""

    def __init__(self):
        self.tail = None
        self.length = 0
        self.steady = False  # the last pass: all decoding, no seed

    def __call__(self, running) -> tuple:
        n = len(running)
        if self.steady and n and running[-1] is self.tail and n <= self.length:
            self.length = n
            return RequestIds(list(running)), False, False
        decoding, seeded, prompt = scan_running(running)
        self.steady = not seeded and not prompt
        self.tail, self.length = (running[-1] if n else None), n
        return decoding, seeded, prompt


class DepthFromVerifier:
    """Stands in for vLLM's dynamic-SD lookup table: `[batch size]` gives
    the drafting depth of the step being scheduled."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.warned = False
        self.scan = RunningScan()
        self.verifier = claim_local_verifier()

    def __getitem__(self, batch_size: int) -> int:
        K = self.scheduler.num_spec_tokens
        verifier = self.verifier
        if verifier is None:
            # Registered after this scheduler was built, if at all.
            verifier = self.verifier = claim_local_verifier()
        if verifier is None:
            if not self.warned:
                self.warned = True
                logger.warning(
                    "vllm-av: no verifier in the scheduler's process (multi-process "
                    "executor); drafting K=%d every step", K,
                )
            return K
        # A request with its own seed is verified in full (as in the
        # synchronous path), so it is drafted in full too.
        decoding, seeded, prompt = self.scan(self.scheduler.running)
        n = len(decoding)
        # No exploration over prompt tokens: a drafter skipped at depth 0
        # would run over all of them at once.
        return verifier.choose_depth(
            decoding, num_sampling=n, num_other_tokens=n, min_depth=K if seeded else 0,
            may_explore=not prompt,
        )


class ScheduledDepthPatch(VllmPatch):
    """Choose the drafting depth when the step is scheduled (async scheduling).

    Target: vllm.v1.core.sched.scheduler:Scheduler.__init__
    Why: under async scheduling the scheduler reserves each step's draft
        slots before the drafts exist, so a depth chosen by the runner after
        drafting (our synchronous path) comes too late.
    How: when our options say `scheduled_depth`, install `DepthFromVerifier`
        as `dynamic_sd_lookup`, the per-batch-size depth table of vLLM's
        dynamic speculative decoding, which the scheduler reads every step
        (and its async scheduler sizes the next step's placeholders from).
    Upstream: a pluggable per-step depth policy in the V1 scheduler.
    Remove when: vLLM's V1 scheduler takes a depth policy object.
    vLLM: 0.32.0
    """

    target = "vllm.v1.core.sched.scheduler:Scheduler"
    attributes = ("__init__",)

    def __init__(self, *args, **kwargs):
        type(self)._orig___init__(self, *args, **kwargs)
        options = av_options_of(self.vllm_config)
        if options is not None and options.scheduled_depth and self.num_spec_tokens > 0:
            self.dynamic_sd_lookup = DepthFromVerifier(self)
            logger.info("vllm-av: drafting depth chosen at scheduling time (async scheduling)")
