"""FULL CUDA graphs for Model Runner V2's draft-model drafter.

vLLM 0.32's V2 draft-model speculator (StandaloneARSpeculator) runs every
draft forward eagerly: its `init_cudagraph_manager` and `capture` are
empty, and `_run_model` always passes CUDAGraphMode.NONE. Each forward of
the torch-compiled draft model then launches its few hundred kernels one
by one from Python. On the H200 a drafting step of K=7 was priced at
108-170 ms against a 1.9 ms target step (thirteenth round), and fixed K on
V2 reached 35-110 tok/s at one request against 425 without speculation
(seventh round): no verification budget can pay for that. With these graphs
(fourteenth round) the K=7 step was profiled at 9.1 ms and fixed K=1
reached 551 tok/s at one request against 486 without speculation.

`MRV2DrafterGraphsPatch` (on where our AV serves a V2 engine;
VLLM_AV_DRAFTER_GRAPHS=0 turns it off, =1 on for fixed K too) captures
the draft model's forward in FULL graphs at start-up (after the target's
graphs, where V2 captures a speculator's) and replays them when the batch
fits:

  prefill graphs  the drafter's first forward over the expanded batch
                  (accepted tokens + correction token per request, at most
                  K + 2 tokens each), one graph per capture size N, for up
                  to N // 2 requests (each has at least two tokens);
  decode graphs   the following one-token-per-request forwards, one graph
                  per capture size N <= max_num_seqs, for up to N requests.

Only the model forward is in the graph; vLLM's own drafting code runs as
before around it, with the graph in force for its metadata builds and
forwards. The attention metadata is built each step by the drafter's own
builders with a FULL batch descriptor, which keeps it in the persistent
buffers the graph reads (query_start_loc, seq_lens, block tables, slot
mappings, FA3's scheduler metadata). Padded tokens get PAD slots (no KV
write) and padded requests zero-length queries. Batches that do not fit
(prompt chunks longer than K + 1, more tokens than the largest graph, data
parallelism, dummy runs without attention) run eagerly as before.

Nothing here reads a drafted token to decide anything; graphs change how
the drafter's forwards are launched, not what they compute.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from vllm_av.vllm.config import av_options_of, env_switch
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")

ENV_DRAFTER_GRAPHS = "VLLM_AV_DRAFTER_GRAPHS"


def drafter_graphs_on(vllm_config=None, env=None) -> bool:
    """VLLM_AV_DRAFTER_GRAPHS=1: on for every draft model on V2 (fixed K
    too); =0: off; unset: on where our AV serves the engine (our options
    in `vllm_config`), so that an engine without it runs as vLLM ships.
    A typo is an error."""
    on = env_switch(ENV_DRAFTER_GRAPHS, env)
    if on is None:
        return vllm_config is not None and av_options_of(vllm_config) is not None
    return on


# ------------------------------------------------------------ graph shapes


@dataclass(frozen=True)
class GraphShape:
    """One captured graph: `kind` "prefill" or "decode", `num_tokens` (the
    padded token count) and `num_reqs` (the padded request count)."""

    kind: str
    num_tokens: int
    num_reqs: int


def prefill_shapes(capture_sizes, max_num_reqs: int, max_tokens: int) -> list[GraphShape]:
    """Prefill graphs: every capture size up to `max_tokens`; a request of
    the expanded batch has at least two tokens, so N tokens hold at most
    N // 2 requests."""
    return [GraphShape("prefill", n, max(1, min(n // 2, max_num_reqs)))
            for n in sorted(set(capture_sizes)) if 2 <= n <= max_tokens]


def decode_shapes(capture_sizes, max_num_reqs: int) -> list[GraphShape]:
    """Decode graphs: one token per request, so N tokens are N requests."""
    return [GraphShape("decode", n, n) for n in sorted(set(capture_sizes)) if n <= max_num_reqs]


def capturable_kinds(support_level: int, K: int) -> tuple[bool, bool]:
    """(prefill, decode): which graphs the drafter's attention backends
    allow, by their least FULL-graph support (vLLM's AttentionCGSupport
    value: 3 any batch, 2 uniform batches, 1 one-token decodes, 0 none).
    Prefill batches mix query lengths; decode batches are one token per
    request, and exist only for K > 1."""
    return support_level >= 3, K > 1 and support_level >= 1


def pick_shape(shapes: list[GraphShape], num_tokens: int, num_reqs: int,
               sizes: list[int] | None = None) -> GraphShape | None:
    """The smallest captured shape that holds the batch (shapes sorted by
    num_tokens, `sizes` their num_tokens if already at hand), or None."""
    if sizes is None:
        sizes = [s.num_tokens for s in shapes]
    i = bisect.bisect_left(sizes, num_tokens)
    for shape in shapes[i:]:
        if shape.num_reqs >= num_reqs:
            return shape
    return None


def capture_query_lens(shape: GraphShape, max_query_len: int) -> np.ndarray:
    """Per-request query lengths of the dummy batch a graph is captured on:
    the first request as long as any replayed request can be (FA3 bakes the
    longest query into the graph), then one token each while tokens last,
    then empty requests (as padded requests are when replayed)."""
    lens = np.zeros(shape.num_reqs, dtype=np.int32)
    first = min(max_query_len, shape.num_tokens)
    lens[0] = first
    rest = min(shape.num_reqs - 1, shape.num_tokens - first)
    lens[1:1 + rest] = 1
    return lens


def capture_bound(shape: GraphShape, max_query_len: int) -> int:
    """The longest query of the dummy batch a graph of `shape` is captured
    on (capture_query_lens: its first request), which its replays' metadata
    must state; computed without building that batch, once per replay."""
    return min(max_query_len, shape.num_tokens)


@dataclass
class DrafterGraphs:
    """The captured graphs of one drafter and their output buffers, tied to
    the KV cache configuration they were captured against."""

    kv_cache_config: object
    # Longest scheduled query a prefill graph takes: K + 1 (K drafts and
    # the bonus token; the expanded batch adds the correction token).
    max_query_len: int = 1
    prefill: list[GraphShape] = field(default_factory=list)
    decode: list[GraphShape] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    replays: int = 0

    def __post_init__(self) -> None:
        # The shapes' token counts, for the lookup every drafting step makes.
        self._prefill_sizes = [s.num_tokens for s in self.prefill]
        self._decode_sizes = [s.num_tokens for s in self.decode]

    def prefill_shape(self, num_tokens: int, num_reqs: int,
                      max_query_len: int) -> GraphShape | None:
        if max_query_len > self.max_query_len:
            return None  # a prompt chunk: longer than any graph was captured for
        return pick_shape(self.prefill, num_tokens, num_reqs, self._prefill_sizes)

    def decode_shape(self, num_reqs: int) -> GraphShape | None:
        return pick_shape(self.decode, num_reqs, num_reqs, self._decode_sizes)

    def replay(self, shape: GraphShape):
        self.graphs[shape].replay()
        self.replays += 1
        return self.outputs[shape]


# ------------------------------------------------------------ the patch


def _graphs_for(speculator) -> DrafterGraphs | None:
    """The speculator's graphs, if captured against its current KV cache
    (V2 captures once against a throwaway cache while profiling memory)."""
    graphs = getattr(speculator, "_vllm_av_graphs", None)
    if graphs is None or graphs.kv_cache_config is not getattr(speculator, "kv_cache_config", None):
        return None
    return graphs


def _full_desc(shape: GraphShape, uniform: bool):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    return BatchExecutionDescriptor(
        cg_mode=CUDAGraphMode.FULL, num_tokens=shape.num_tokens, num_reqs=shape.num_reqs,
        uniform_token_count=1 if uniform else None)


class MRV2DrafterGraphsPatch(VllmPatch):
    """FULL CUDA graphs for Model Runner V2's draft-model forwards.

    Target: vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator:StandaloneARSpeculator.init_cudagraph_manager, capture, _prefill, _multi_step_decode, _build_attn_metadata, _run_model
    Why: vLLM 0.32's V2 draft-model speculator captures no CUDA graph
        ("CUDA graph not yet supported for standalone AR speculator") and
        runs each draft forward eagerly; on the H200 a K=7 drafting step was
        profiled at 108-170 ms against a 1.9 ms target step, so no drafting
        depth could ever pay there.
    How: where our AV serves the engine (VLLM_AV_DRAFTER_GRAPHS=0: never;
        =1: for fixed K too), `capture` (called by the runner
        after the target's graphs) captures the draft model's forward in
        FULL graphs over the capture sizes, for the first draft forward
        (the expanded batch, up to K + 2 tokens per request) and for the
        one-token decode forwards (each kind where the drafter's attention
        backends support FULL graphs of it). `_prefill` and
        `_multi_step_decode` pick the smallest graph that holds the batch
        and run vLLM's own code with it in force: `_build_attn_metadata`
        then builds for the graph's padded shape (the persistent buffers it
        reads) and `_run_model` replays it; the decode loop's padded
        requests get empty queries. Batches that fit no graph, dummy runs
        without attention and data parallelism run unchanged.
        `init_cudagraph_manager` drops graphs captured against an earlier
        KV cache.
    Upstream: CUDA graph support in StandaloneARSpeculator, as its EAGLE
        sibling (TargetDependentARSpeculator) has.
    Remove when: vLLM's V2 draft-model speculator captures its forwards.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator:StandaloneARSpeculator"
    attributes = ("init_cudagraph_manager", "capture", "_prefill", "_multi_step_decode",
                  "_build_attn_metadata", "_run_model")
    platforms = ("cuda",)

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        type(self)._orig_init_cudagraph_manager(self, cudagraph_mode)
        self._vllm_av_graphs = None
        self._vllm_av_cg_full = bool(cudagraph_mode.has_full_cudagraphs())

    def capture(self) -> None:
        type(self)._orig_capture(self)
        self._vllm_av_graphs = None
        if not drafter_graphs_on(self.vllm_config) or not getattr(self, "_vllm_av_cg_full", False):
            return
        _capture(self)

    def _prefill(self, input_batch, num_rejected, last_sampled, num_reqs, skip_attn,
                 num_tokens_across_dp):
        shape = None
        graphs = _graphs_for(self)
        if graphs is not None and not skip_attn and num_tokens_across_dp is None:
            qsl = input_batch.query_start_loc_np
            longest = int((qsl[1:num_reqs + 1] - qsl[:num_reqs]).max())
            shape = graphs.prefill_shape(input_batch.num_tokens + num_reqs, num_reqs, longest)
        with _replaying(self, shape):
            return type(self)._orig__prefill(self, input_batch, num_rejected, last_sampled,
                                             num_reqs, skip_attn, num_tokens_across_dp)

    def _multi_step_decode(self, input_batch, num_rejected, num_reqs, skip_attn,
                           num_tokens_across_dp):
        shape = None
        graphs = _graphs_for(self)
        if graphs is not None and not skip_attn and num_tokens_across_dp is None:
            shape = graphs.decode_shape(num_reqs)
        if shape is not None:
            # The decode loop sets the first num_reqs + 1 entries; the padded
            # requests past them get empty queries.
            self.input_buffers.query_start_loc[num_reqs + 1: shape.num_reqs + 1].fill_(num_reqs)
        with _replaying(self, shape):
            return type(self)._orig__multi_step_decode(self, input_batch, num_rejected, num_reqs,
                                                       skip_attn, num_tokens_across_dp)

    def _build_attn_metadata(self, *args, **kwargs):
        shape = getattr(self, "_vllm_av_replay", None)
        if shape is None:
            return type(self)._orig__build_attn_metadata(self, *args, **kwargs)
        # The graph's shape: the builders then write the persistent buffers
        # the graph reads, padded as it was captured.
        desc = _full_desc(shape, uniform=shape.kind == "decode")
        if "batch_desc" in kwargs:
            kwargs["batch_desc"] = desc
        else:
            args = (args[0], desc, *args[2:])
        # A prefill graph was captured with its first request as long as any
        # replayed one can be: its replays are built at that bound
        # (MRV2DraftMetadataBoundPatch).
        bound = (capture_bound(shape, self._vllm_av_graphs.max_query_len + 1)
                 if shape.kind == "prefill" else None)
        _METADATA_BOUND["max_query_len"] = bound
        try:
            return type(self)._orig__build_attn_metadata(self, *args, **kwargs)
        finally:
            _METADATA_BOUND["max_query_len"] = None

    def _run_model(self, input_ids, *args, **kwargs):
        shape = getattr(self, "_vllm_av_replay", None)
        if shape is None:
            return type(self)._orig__run_model(self, input_ids, *args, **kwargs)
        # The inputs sit in the buffers the graph was captured on.
        return self._vllm_av_graphs.replay(shape)[: input_ids.shape[0]]


# The bound a draft metadata build in flight must state (set around the
# build of a prefill graph's replay; None otherwise).
_METADATA_BOUND: dict = {"max_query_len": None}


def build_attn_metadata(*args, **kwargs):
    """vLLM's `build_attn_metadata` as the speculator module calls it, with
    `max_query_len` raised to the bound of the prefill graph being replayed."""
    bound = _METADATA_BOUND["max_query_len"]
    if bound is not None and kwargs.get("max_query_len") is not None:
        kwargs["max_query_len"] = max(int(kwargs["max_query_len"]), bound)
    module = importlib.import_module(MRV2DraftMetadataBoundPatch.target)
    return module._orig_build_attn_metadata(*args, **kwargs)


class MRV2DraftMetadataBoundPatch(VllmPatch):
    """Build a drafter prefill graph's replay metadata at its capture bound.

    Target: vllm.v1.worker.gpu.spec_decode.speculator.build_attn_metadata
    Why: `_build_attn_metadata` states the longest query of the host's
        layout, which is shorter than the K + 2 tokens our prefill graphs
        were captured with (and, under our trimming, the host deals the
        budget round-robin, so it can be shorter than the device's longest
        query). On the target side the same kind of mismatch (metadata for
        one token replayed through a graph captured for K + 1) gave wrong
        outputs on the H200 (MRV2ReplayBoundPatch); here it would give
        wrong drafts.
    How: while `MRV2DrafterGraphsPatch._build_attn_metadata` builds the
        metadata of a prefill graph's replay, the speculator module's
        `build_attn_metadata` gets `max_query_len` raised to that graph's
        capture bound; every other call passes through unchanged.
    Upstream: CUDA graphs for StandaloneARSpeculator (their replay metadata
        then built at the captured bound).
    Remove when: MRV2DrafterGraphsPatch goes.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.spec_decode.speculator"
    attributes = ("build_attn_metadata",)
    platforms = ("cuda",)

    # A plain function on the class lands on the module as a function.
    build_attn_metadata = build_attn_metadata


@contextlib.contextmanager
def _replaying(speculator, shape: GraphShape | None):
    """Within: the speculator's metadata builds and forwards use the graph
    of `shape` (None: vLLM's eager path)."""
    speculator._vllm_av_replay = shape
    try:
        yield
    finally:
        speculator._vllm_av_replay = None


# ------------------------------------------------------------ capture


def _capture(spec) -> None:
    import torch

    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    config = spec.vllm_config.compilation_config
    sizes = config.cudagraph_capture_sizes or []
    K = spec.num_speculative_steps
    # The drafter's attention groups' least FULL-graph support (set_attn);
    # unknown counts as none: the forwards then stay eager, as vLLM runs them.
    support = getattr(spec, "attn_cg_support", None)
    level = getattr(getattr(support, "min_cg_support", None), "value", 0)
    prefill_ok, decode_ok = capturable_kinds(level, K)
    if not (prefill_ok or decode_ok):
        logger.info("vllm-av: draft model forwards left eager: attention backend %s "
                    "supports no FULL CUDA graph of them",
                    getattr(support, "min_cg_attn_backend", None))
        return
    max_prefill_tokens = min(max(sizes, default=0), spec.max_num_reqs * (K + 2),
                             spec.expanded_input_ids.shape[0])
    graphs = DrafterGraphs(
        kv_cache_config=spec.kv_cache_config,
        max_query_len=K + 1,
        prefill=(prefill_shapes(sizes, spec.max_num_reqs, max_prefill_tokens)
                 if prefill_ok else []),
        decode=decode_shapes(sizes, spec.max_num_reqs) if decode_ok else [],
    )
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        spec.last_token_indices.zero_()
        spec.idx_mapping.zero_()
        # Largest first: later, smaller graphs reuse the pool's blocks.
        for shape in sorted(graphs.prefill + graphs.decode, key=lambda s: -s.num_tokens):
            max_query_len = K + 2 if shape.kind == "prefill" else 1
            # Warm-up (lazy allocations, autotuning) outside the graph, then
            # capture with freshly built metadata.
            _dummy_forward(spec, shape, max_query_len, PAD_SLOT_ID)()
            run = _dummy_forward(spec, shape, max_query_len, PAD_SLOT_ID)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run()
            graphs.graphs[shape] = graph
            graphs.outputs[shape] = out
    torch.cuda.synchronize()
    spec._vllm_av_graphs = graphs
    logger.info("vllm-av: draft model forwards in FULL CUDA graphs: %d prefill sizes (<= %d "
                "tokens), %d decode sizes (<= %d requests), captured in %.1f s",
                len(graphs.prefill), max((s.num_tokens for s in graphs.prefill), default=0),
                len(graphs.decode), max((s.num_reqs for s in graphs.decode), default=0),
                time.perf_counter() - t0)


def _dummy_forward(spec, shape: GraphShape, max_query_len: int, pad_slot: int):
    """The forward a graph of `shape` records, over a dummy batch laid out by
    capture_query_lens, reading the buffers the replays will fill."""
    import torch

    from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer

    lens = capture_query_lens(shape, max_query_len)
    qsl = np.zeros(shape.num_reqs + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    bufs = spec.input_buffers
    bufs.query_start_loc[: shape.num_reqs + 1].copy_(torch.from_numpy(qsl))
    bufs.seq_lens[: shape.num_reqs].copy_(torch.from_numpy(lens))
    spec.block_tables.get_dummy_block_tables(shape.num_reqs)
    if shape.kind == "prefill":
        spec.expanded_slot_mappings.fill_(pad_slot)
        slots = spec.expanded_slot_mappings[:, : shape.num_tokens]
        input_ids = spec.expanded_input_ids[: shape.num_tokens]
        positions = spec.expanded_positions[: shape.num_tokens]
    else:
        slots = spec.block_tables.get_dummy_slot_mappings(shape.num_tokens)
        input_ids = bufs.input_ids[: shape.num_tokens]
        positions = bufs.positions[: shape.num_tokens]
    attn_metadata = spec._build_attn_metadata(
        num_reqs=shape.num_reqs, batch_desc=_full_desc(shape, shape.kind == "decode"),
        query_start_loc_np=qsl, seq_lens_cpu_upper_bound=torch.from_numpy(lens.copy()),
        step=0, slot_mappings=slots)
    slots_by_layer = build_slot_mappings_by_layer(slots, spec.kv_cache_config)

    def run():
        return spec._run_model(input_ids, positions, attn_metadata, slots_by_layer, None)

    return run
