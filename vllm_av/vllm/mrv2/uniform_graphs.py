"""Uniform FULL decode graphs beside Model Runner V2's varlen AV graphs.

With adaptive verification on, vLLM 0.32's V2 graph manager captures its
FULL decode graphs as varlen graphs only: each replays any mix of 1..K+1
query tokens per request and is captured for K+1 (`max_query_len`). Plain
V2 replays uniform one-token graphs, and fixed K=1 uniform two-token ones;
neither is captured with AV on. So a step of ours at depth 0 (every request
one token) or at depth 1 with every draft admitted (every request two)
replays a graph whose attention was captured for K+1 query tokens per
request. On the H200 (sixteenth round) a depth-0 step cost 0.3-1.4 ms more
than a plain V2 step, and a depth-1 step at C >= 32 more than K=1's. With
these graphs (option `uniform_decode_graphs`, on by default) a depth-0
step at one request took 2.2 ms, as plain V2's, against 2.7-2.9 ms
replaying the varlen graph (twentieth round).

`MRV2UniformDecodeGraphsPatch` adds, beside each varlen descriptor, FULL
descriptors of exactly u tokens per request for u in UNIFORM_COUNTS (where
the size holds a whole number of such requests, at most max_num_seqs), and
puts them first among that size's candidates. Each has `max_query_len` u,
so it serves only a step whose scheduled query lengths are all at most u
and whose laid-out lengths are all u: a step where the budget trimmed some
drafts carries the scheduler's larger bound, or unequal lengths, and still
dispatches to the varlen graph, whose attention metadata is built for that
bound. Capture builds them as vLLM builds uniform decode graphs (u tokens
per dummy request, `max_query_len` u), and the memory profile counts them
with the others, since they sit in the capture list before it runs.

Our start-up cost profile's dummy runs (one token per request up to
max_num_seqs) then time the one-token graphs: the tables price a step that
verifies nothing as it now runs, and a step with drafts at that price too
(on V2 only option step_period_calibration corrects it).
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")

# Tokens per request of the uniform graphs: depth 0 and depth 1, the depths
# adaptive depth chose on nearly every step with the H200 pair.
UNIFORM_COUNTS = (1, 2)


def uniform_twins(desc, max_num_reqs: int, counts=UNIFORM_COUNTS) -> list:
    """FULL descriptors of exactly u tokens per request, for u in `counts`,
    of the varlen decode descriptor `desc`'s size (none for other modes,
    microbatched graphs, or sizes that hold no whole number of requests)."""
    if desc.max_query_len is None or desc.uniform_token_count is not None:
        return []
    if desc.num_reqs is None or desc.num_ubatches != 1:
        return []
    return [dataclasses.replace(desc, num_reqs=desc.num_tokens // u, uniform_token_count=u,
                                max_query_len=u)
            for u in counts
            if u < desc.max_query_len and desc.num_tokens % u == 0
            and desc.num_tokens // u <= max_num_reqs]


def add_uniform_graphs(capture_descs: dict, candidates: dict, full_mode,
                       max_num_reqs: int) -> list:
    """Add the uniform twins of `capture_descs[full_mode]`'s varlen
    descriptors to the capture list (largest first, as vLLM keeps it) and to
    every candidate list, right before their varlen original (dispatch takes
    the first compatible candidate). Returns the descriptors added."""
    full = capture_descs.get(full_mode, [])
    have = set(full)
    twins = {}
    for d in full:
        new = [t for t in uniform_twins(d, max_num_reqs) if t not in have]
        if new:
            twins[d] = new
            have.update(new)
    if not twins:
        return []
    added = [t for new in twins.values() for t in new]
    capture_descs[full_mode] = sorted([*full, *added], key=lambda d: d.num_tokens, reverse=True)
    for key, descs in candidates.items():
        out = []
        for d in descs:
            out.extend(twins.get(d, ()))
            out.append(d)
        candidates[key] = out
    return added


def keep_captured_twins(candidates: dict, graphs, every_candidate: dict, twins) -> None:
    """After a capture: each size's candidates as `every_candidate` lists
    them, less those of `twins` (the descriptors `add_uniform_graphs` added)
    that were not captured. vLLM's memory profile captures only the two
    largest FULL graphs, then our cost profile runs dummy steps at their
    sizes; a twin left first among its size's candidates would be
    dispatched there with no graph behind it (with one request slot and
    K = 3 the two-token twin has the second largest size, and start-up
    failed with "No cudagraph for ...")."""
    for key, descs in every_candidate.items():
        candidates[key] = [d for d in descs if d not in twins or d in graphs]


class MRV2UniformDecodeGraphsPatch(VllmPatch):
    """Capture uniform FULL decode graphs beside V2's varlen AV graphs.

    Target: vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager._init_candidates, .capture
    Why: with adaptive verification, V2 captures FULL decode graphs only as
        varlen graphs for K+1 query tokens per request, so a step that
        schedules no draft (adaptive depth 0), or one draft per request all
        admitted (depth 1), does not replay the uniform graph that plain V2
        decoding, or fixed K=1, replays.
    How: with option uniform_decode_graphs and varlen decode on, after
        vLLM's candidate lists are built, add for each varlen descriptor
        FULL descriptors of exactly 1 and 2 tokens per request, each with
        max_query_len equal to that count (`add_uniform_graphs`), first
        among their size's candidates and in the capture list; after each
        capture, drop from the candidates those twins it did not capture
        (vLLM's memory profile captures only the largest FULL graphs).
    Upstream: capture uniform decode graphs for the common draft lengths
        beside varlen ones.
    Remove when: vLLM's V2 graph manager captures them itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager"
    attributes = ("_init_candidates", "capture")
    platforms = ("cuda",)

    def _init_candidates(self) -> None:
        MRV2UniformDecodeGraphsPatch.original("_init_candidates")(self)
        self._vllm_av_twins = None
        options = av_options_of(self.vllm_config)
        if options is None or not options.uniform_decode_graphs or not self.varlen_decode:
            return
        from vllm.config.compilation import CUDAGraphMode

        added = add_uniform_graphs(self._capture_descs, self._candidates, CUDAGraphMode.FULL,
                                   self.max_num_reqs)
        if added:
            self._vllm_av_twins = (set(added), {k: list(v) for k, v in self._candidates.items()})
            logger.info("vllm-av (MRV2): %d uniform FULL decode graphs (1 and 2 tokens per "
                        "request) beside the varlen ones (option uniform_decode_graphs)", len(added))

    def capture(self, *args, **kwargs) -> None:
        # Not type(self)._orig_capture: the drafters' SpeculatorCudaGraphManager
        # (its own capture patched, target_drafter.py) reaches this through
        # super() with vLLM's base arguments.
        MRV2UniformDecodeGraphsPatch.original("capture")(self, *args, **kwargs)
        added = getattr(self, "_vllm_av_twins", None)
        if added:
            twins, every_candidate = added
            keep_captured_twins(self._candidates, self.graphs, every_candidate, twins)
