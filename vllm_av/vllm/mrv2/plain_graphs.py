"""One-token FULL graphs for Model Runner V2 steps that verify no draft.

With adaptive verification on, vLLM 0.32's V2 graph manager captures its
FULL decode graphs as varlen graphs only: each replays any mix of 1..K+1
query tokens per request and is captured for K+1 (`max_query_len`). The
uniform one-token decode graphs that plain V2 replays are not captured at
all, so a step of adaptive depth 0 (no draft scheduled: every request one
token) replays a graph whose attention was captured for K+1 query tokens
per request. On the H200 (sixteenth round) such a step cost 0.3-1.4 ms
more than a plain V2 step; what part of that is this graph is what this
option measures.

`MRV2PlainDecodeGraphsPatch` adds, beside each varlen descriptor of one
token per request at most (num_tokens == num_reqs), a FULL descriptor of
exactly one token per request, and puts it first among that size's
candidates. Its `max_query_len` is 1, so it only serves a step whose
scheduled query lengths are all 1: a step with drafts scheduled (even if
the budget then admits none of them) carries the scheduler's larger bound
and still dispatches to the varlen graph, whose attention metadata is built
for that bound. Capture builds it as plain V2 builds its uniform decode
graphs (one token per dummy request, `max_query_len` 1), and the memory
profile counts it with the others, since it sits in the capture list
before that profile runs. Our start-up cost profile's dummy runs (one
token per request up to max_num_seqs) then time these graphs: the tables
price a step that verifies nothing as it now runs, and a step with drafts
at that price too (on V2 only option step_period_calibration corrects it).
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")


def one_token_twin(desc):
    """The FULL one-token-per-request twin of a varlen decode descriptor
    (None where there is none: other modes, graphs of more tokens than
    requests, microbatched graphs)."""
    if desc.max_query_len is None or desc.uniform_token_count is not None:
        return None
    if desc.num_reqs is None or desc.num_reqs != desc.num_tokens or desc.num_ubatches != 1:
        return None
    return dataclasses.replace(desc, uniform_token_count=1, max_query_len=1)


def add_one_token_graphs(capture_descs: dict, candidates: dict, full_mode) -> int:
    """Add the twins of `capture_descs[full_mode]`'s varlen descriptors to
    the capture list (largest first, as vLLM keeps it) and to every
    candidate list, right before their varlen original (dispatch takes the
    first compatible candidate). Returns how many were added."""
    full = capture_descs.get(full_mode, [])
    twins = {d: t for d in full if (t := one_token_twin(d)) is not None and t not in full}
    if not twins:
        return 0
    capture_descs[full_mode] = sorted([*full, *twins.values()],
                                      key=lambda d: d.num_tokens, reverse=True)
    for key, descs in candidates.items():
        out = []
        for d in descs:
            if d in twins:
                out.append(twins[d])
            out.append(d)
        candidates[key] = out
    return len(twins)


class MRV2PlainDecodeGraphsPatch(VllmPatch):
    """Capture one-token FULL decode graphs beside V2's varlen AV graphs.

    Target: vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager._init_candidates
    Why: with adaptive verification, V2 captures FULL decode graphs only as
        varlen graphs for K+1 query tokens per request, so a step that
        schedules no draft (adaptive depth 0) does not replay the
        one-token graph plain V2 decoding replays.
    How: with option plain_decode_graphs and varlen decode on, after
        vLLM's candidate lists are built, add for each varlen descriptor of
        one token per request a FULL descriptor with uniform_token_count 1
        and max_query_len 1 (`add_one_token_graphs`), first among its
        size's candidates and in the capture list.
    Upstream: capture uniform one-token decode graphs beside varlen ones
        when the step count of drafts can be zero.
    Remove when: vLLM's V2 graph manager captures them itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager"
    attributes = ("_init_candidates",)
    platforms = ("cuda",)

    def _init_candidates(self) -> None:
        type(self)._orig__init_candidates(self)
        options = av_options_of(self.vllm_config)
        if options is None or not options.plain_decode_graphs or not self.varlen_decode:
            return
        from vllm.config.compilation import CUDAGraphMode

        added = add_one_token_graphs(self._capture_descs, self._candidates, CUDAGraphMode.FULL)
        if added:
            logger.info("vllm-av (MRV2): %d one-token FULL decode graphs beside the varlen "
                        "ones (option plain_decode_graphs)", added)
