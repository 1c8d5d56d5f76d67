"""Adaptive drafting depth on Model Runner V2 (draft models).

The depth of each step is chosen when the step is scheduled, as on V1
with async scheduling: `ScheduledDepthPatch` (mrv1/scheduled_depth.py, the
scheduler is V1's for both runners) asks the local verifier, here our MRV2
manager, through `AVManager.choose_depth`. The choice itself is the core's
(`AdaptiveVerifier.choose_depth`: the expected-tokens-per-time search over
depths with exploration), read over the manager's host copies of the
confidences: `MRV2DepthPolicy` supplies the stale rows and the prior.

V2's runner passes that depth to `speculator.propose(num_speculative_tokens
=d)` and masks drafts past d with -1, but vLLM 0.32's draft-model speculator
ignores it and runs all K forwards. `MRV2DraftDepthPatch` makes it stop: at
depth 0 the drafter is skipped (a plain step), at depth d < K it runs d
forwards, and the confidences of its slots not drafted are set to the
estimator's prior, so the next budget and depth never read another
request's leftovers.
With option zero_depth_skips_drafter off, depth 0 runs the drafter's first
forward alone instead, so drafts after depth-0 steps see a KV cache without
holes; the cost model then prices depth 0 as that forward.
A depth-0 step costs a plain step plus host bookkeeping: our manager
records no confidences (no host wait on the copy stream) and our estimator
skips the step's empty observation.
Nothing here reads a drafted token (DESIGN 2.5): the depth comes from
earlier steps' confidences and profiled costs.
"""

from __future__ import annotations

import numpy as np

from vllm_av.core.verifier import AdaptiveVerifier
from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.mrv2.catch_up import (CatchUpLedger, bind_ledger, plan_for, rows_capacity,
                                        set_plan)
from vllm_av.vllm.patching import VllmPatch


class MRV2DepthPolicy(AdaptiveVerifier):
    """The core's depth choice over an MRV2 manager's stale confidences.

    Only the depth half of AdaptiveVerifier is used (`choose_depth` and
    what it calls); admission stays with vLLM's MRV2 machinery and our
    manager. The rows it reads are the manager's landed host copy (one
    step old, like the V1 path's)."""

    def __init__(self, manager) -> None:
        super().__init__(manager.num_speculative_steps, manager.cost)
        self.manager = manager
        self.counts_depths = False  # the manager counts what its steps ran

    def stale_scores(self, req_ids: list[str], num_drafted: np.ndarray) -> np.ndarray:
        rows = self.manager.stale_survival(req_ids)  # [R, K]
        n = np.minimum(np.asarray(num_drafted), self.K)
        return rows[np.arange(self.K) < n[:, None]]

    def _prior_host(self) -> np.ndarray:
        return self.manager.prior_survival_host()


# Whether the last `propose` of this process skipped the drafter (depth 0):
# the runner's `record_confidences` that follows it then has nothing new to
# record and returns before its host wait (AVManager.record_confidences).
_LAST_PROPOSE = {"skipped": False}


def drafter_skipped() -> bool:
    return _LAST_PROPOSE["skipped"]


def note_propose(skipped: bool) -> None:
    """Called by each speculator's `propose` (draft model, ngram)."""
    _LAST_PROPOSE["skipped"] = skipped


# The depth the start-up profile's dummy runs draft at (None: vLLM's K).
# Our manager sets it while vLLM runs the batches it yields for timing, so
# that the drafter's cost is profiled at depth 1 as well as at K.
_PROFILE_DEPTH = {"depth": None}


def set_profile_depth(depth: int | None) -> None:
    _PROFILE_DEPTH["depth"] = depth


def profile_depth() -> int | None:
    """The depth the start-up profile's dummy runs draft at now (None: K)."""
    return _PROFILE_DEPTH["depth"]


def depth_options(speculator) -> tuple[bool, bool, bool]:
    """(adaptive depth on, depth 0 runs the drafter's first forward, the
    drafter catches up on what depth-0 steps skipped), read once from our
    options: the second with option zero_depth_skips_drafter off, so that
    the drafter's KV cache has no holes; the third with it on and option
    drafter_catch_up, which fills the holes when the drafter next runs."""
    cached = getattr(speculator, "_vllm_av_depth_options", None)
    if cached is None:
        options = av_options_of(speculator.vllm_config)
        on = bool(options is not None and options.scheduled_depth)
        keep = on and not options.zero_depth_skips_drafter
        cached = (on, keep, on and not keep and options.drafter_catch_up)
        speculator._vllm_av_depth_options = cached
    return cached


def _ledger(speculator) -> CatchUpLedger:
    ledger = getattr(speculator, "_vllm_av_catch_up", None)
    if ledger is None:
        ledger = speculator._vllm_av_catch_up = CatchUpLedger(
            speculator.max_num_reqs, speculator.num_speculative_steps)
        bind_ledger(ledger)
    return ledger


def _query_lens(input_batch) -> np.ndarray:
    """Each request's scheduled tokens: an upper bound of those it ran.
    Not the host's query starts, which under our trimming deal the step's
    budget round-robin (only their total is right), so a request that
    verified more drafts than it was dealt would be caught up short."""
    n = input_batch.num_reqs
    return np.asarray(input_batch.num_scheduled_tokens[:n], dtype=np.int64)


def _drafting(speculator, orig, steps: int, catch_up: bool, input_batch,
              *args, **kwargs) -> None:
    """vLLM's propose at `steps` forwards, the first one widened by the
    positions each request missed when catching up."""
    plan = None
    if catch_up:
        ledger = _ledger(speculator)
        input_batch, plan = plan_for(ledger, input_batch, rows_capacity(speculator))
        ledger.drafted(steps)
    set_plan(plan)
    try:
        _propose_steps(speculator, orig, steps, input_batch, *args, **kwargs)
    finally:
        set_plan(None)


def _propose_steps(speculator, orig, steps: int, *args, **kwargs) -> None:
    """vLLM's propose with its step count set to `steps` for the call (its
    decode loop and its one-step early return read it), then K again."""
    K = speculator.num_speculative_steps
    speculator.num_speculative_steps = steps
    try:
        orig(speculator, *args, **kwargs)
    finally:
        speculator.num_speculative_steps = K


def prior_for_undrafted(speculator, num_reqs: int, depth: int) -> None:
    """Slots from `depth` on were not drafted this step: give them the
    estimator's prior (device copy, no sync)."""
    conf = getattr(speculator, "draft_token_confidence_probs", None)
    est = getattr(speculator, "acceptance_estimator", None)
    if conf is None or est is None or not hasattr(est, "prior_confidences"):
        return
    conf[:num_reqs, depth:] = est.prior_confidences()[depth:].to(conf.dtype)


class MRV2DraftDepthPatch(VllmPatch):
    """Draft only the scheduled depth with Model Runner V2's draft model.

    Target: vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator:StandaloneARSpeculator.propose
    Why: V2's runner passes the scheduled depth (`num_speculative_tokens`)
        to `propose`, but vLLM 0.32's draft-model speculator always runs its
        K forwards and the runner throws the drafts past the depth away, so
        a step of depth 0 still pays the whole drafter and adaptive depth
        could never be cheaper than fixed K.
    How: with our adaptive depth on (options.scheduled_depth), depth 0
        returns the speculator's draft buffer without running the drafter
        (the runner masks it all with -1; with option
        zero_depth_skips_drafter off, after the drafter's first forward
        alone, which keeps its KV cache whole) and tells our manager that
        there is nothing to record (`drafter_skipped`); depth d < K runs the original
        with its step count set to d for the call (its decode loop and its
        one-step early return read that count), then restores K. Slots not
        drafted get the estimator's prior confidences. Depth K runs
        unchanged, and so do dummy runs, except those of our start-up
        profile at depth 1 (`set_profile_depth`), which draft that deep.
        With option drafter_catch_up, depth-0 steps enter their queries in
        a `CatchUpLedger` and the next drafting call hands vLLM a batch
        widened by what each request missed (MRV2CatchUpInputsPatch lays
        it out).
    Upstream: honour `num_speculative_tokens` in StandaloneARSpeculator.propose.
    Remove when: vLLM's V2 draft-model speculator stops at the depth it is given.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator:StandaloneARSpeculator"
    attributes = ("propose",)
    platforms = ("cuda",)

    def propose(self, input_batch, *args, **kwargs):
        orig = type(self)._orig_propose
        K = self.num_speculative_steps
        depth = kwargs.get("num_speculative_tokens")
        note_propose(False)
        on, zero_depth_forward, catch_up = depth_options(self)
        at_depth = profile_depth()
        if kwargs.get("dummy_run") and on and at_depth is not None and at_depth < K:
            # A start-up profile's dummy run timed at this depth.
            _propose_steps(self, orig, at_depth, input_batch, *args, **kwargs)
            return self.draft_tokens[: input_batch.num_reqs]
        if kwargs.get("dummy_run") or not on:
            return orig(self, input_batch, *args, **kwargs)
        n = input_batch.num_reqs
        if depth is None or depth >= K:
            _drafting(self, orig, K, catch_up, input_batch, *args, **kwargs)
            return self.draft_tokens[:n]
        depth = max(int(depth), 0)
        if depth == 0:
            # Nothing verified, nothing to record: the buffer's confidences
            # are not read before the next drafting step overwrites them.
            note_propose(True)
            if zero_depth_forward:
                # Only the first forward, for the drafter's KV cache; the
                # runner masks its draft (depth 0).
                _propose_steps(self, orig, 1, input_batch, *args, **kwargs)
            elif catch_up:
                # The drafter misses this step's positions until it next runs.
                ledger = _ledger(self)
                ledger.skipped(input_batch.req_ids[:n], input_batch.idx_mapping_np[:n],
                               _query_lens(input_batch))
                ledger.drafted(0)
            return self.draft_tokens[:n]
        _drafting(self, orig, depth, catch_up, input_batch, *args, **kwargs)
        prior_for_undrafted(self, n, depth)
        return self.draft_tokens[:n]

