"""Target steps that replay a varlen FULL graph build its metadata at its bound.

With adaptive verification on, vLLM 0.32's V2 graph manager captures its
FULL decode graphs as varlen graphs: one per size, captured with
`max_query_len` K+1 (K drafts and the bonus token per request), and
dispatches to it any decode step whose longest query is at most K+1. The
replayed step's attention metadata is then built from the step's own
bound (`InputBatch.max_query_len`: the longest scheduled query when drafts
are scheduled, else the longest query), while the graph's attention
kernels were recorded for K+1. vLLM's own AV schedules K drafts on every
decode step, so the two agree there. Our adaptive depth schedules fewer:
at depth d < K the longest query is d+1, and at depth 0 every query is
one token.

On the H200 (nineteenth round) that mismatch broke the output
distribution: with the depth forced to alternate 0 and K, the tiny pair's
second and third tokens failed the chi-square test (p = 8e-30 to 3e-144)
whether depth 0 skipped the drafter or ran it, and whether the budget
trimmed or not, while depth K on every step passed with the same
trimming. The prompt's token (a prefill, never a varlen graph) passed
every time. Metadata built for a one-token bound and replayed through
kernels recorded for K+1 is the one thing those failing runs share.

`MRV2ReplayBoundPatch` builds a replayed step's metadata at the bound the
graph was captured with, as vLLM's capture built it: an upper bound on
every query, which is what attention metadata states. Steps that run
eagerly or piecewise, or replay a uniform graph (captured at its own
token count), keep their own bound.
"""

from __future__ import annotations

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch


_FULL: list = []


def _full_mode():
    """vLLM's CUDAGraphMode.FULL, imported once (this runs every step)."""
    if not _FULL:
        from vllm.config.compilation import CUDAGraphMode

        _FULL.append(CUDAGraphMode.FULL)
    return _FULL[0]


def replay_bound(batch_desc, own_bound: int | None) -> int | None:
    """The `max_query_len` a step's attention metadata is built with: the
    captured bound of the varlen FULL graph `batch_desc` replays, else the
    step's own (`own_bound`; None: its longest query)."""
    bound = batch_desc.max_query_len
    if (batch_desc.cg_mode != _full_mode() or bound is None
            or batch_desc.uniform_token_count is not None):
        return own_bound
    # Dispatch admits a step only when its longest query is within the bound.
    return max(bound, own_bound or 0)


class MRV2ReplayBoundPatch(VllmPatch):
    """Build a replayed varlen graph's attention metadata at its capture bound.

    Target: vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs
    Why: V2 captures its AV decode graphs for K+1 query tokens per request
        but builds a replayed step's attention metadata for the step's own
        longest query; with our adaptive depth a step can schedule fewer
        drafts than K (one token per request at depth 0), and on the H200
        such steps gave the target a wrong output distribution.
    How: where our AV serves the engine, after vLLM lays out the step, a
        step that replays a varlen FULL graph (FULL mode, no uniform token
        count, a max_query_len bound) gets that bound as its
        `InputBatch.max_query_len`, the value the metadata builders read
        (`replay_bound`). Other steps are unchanged, and so is everything
        with vLLM's own AV.
    Upstream: build replayed varlen decode steps' attention metadata with
        the descriptor's max_query_len.
    Remove when: vLLM's V2 runner builds replay metadata at the graph's bound.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
    attributes = ("prepare_inputs",)
    platforms = ("cuda",)

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, *args, **kwargs):
        batch = type(self)._orig_prepare_inputs(self, scheduler_output, batch_req_state,
                                                batch_desc, *args, **kwargs)
        serves = getattr(self, "_vllm_av_replay_bound", None)
        if serves is None:  # decided once: the config does not change
            serves = self._vllm_av_replay_bound = (
                getattr(self, "pcp_manager", None) is None
                and av_options_of(self.vllm_config) is not None)
        # A uniform graph, or no graph with a bound (eager, piecewise): the
        # step keeps its own bound, with no call (this runs every step).
        if (serves and batch_desc.uniform_token_count is None
                and batch_desc.max_query_len is not None):
            batch.max_query_len = replay_bound(batch_desc, batch.max_query_len)
        return batch
