"""FULL CUDA graphs for every batch shape our AV makes on the V1 runner.

With speculation configured, vLLM 0.32's V1 runner (FULL_AND_PIECEWISE, its
default) replays a FULL graph only for "uniform decode" batches, where every
request brings exactly 1+K tokens. Our AV makes other shapes on purpose: a
step of drafting depth 0 brings 1 token per request, a trimmed step any mix
of 1..K+1. Those fell to the piecewise graphs, which on the H200 cost 8.6 ms
for 8 tokens of the 1.5B target against ~2.5 ms for a whole plain decode
step (docs/RESULTS.md, 2026-11-29), so the saving of a short step was lost
to the runner.

Where the attention backend can replay any batch inside a FULL graph
(FlashAttention 3 says `AttentionCGSupport.ALWAYS`), we add FULL keys for
the mixed-batch shape at every capture size. vLLM's own capture loop then
captures them beside its uniform-decode graphs, and its dispatcher picks
them for any batch up to the largest capture size. The drafter keeps its
piecewise graphs (it has its own dispatcher): cudagraph_mode FULL for the
whole engine would take those away.
"""

from __future__ import annotations

import logging

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")


def backends_replay_any_batch(attention_backends, kv_cache_groups, vllm_config) -> bool:
    """Whether every attention backend of the target can run a mixed batch
    inside a FULL CUDA graph."""
    from vllm.v1.attention.backend import AttentionCGSupport

    for backends, group in zip(attention_backends, kv_cache_groups):
        for backend in backends:
            support = backend.get_builder_cls().get_cudagraph_support(
                vllm_config, group.kv_cache_spec
            )
            if support != AttentionCGSupport.ALWAYS:
                return False
    return True


def add_varlen_full_keys(dispatcher, max_num_seqs: int) -> int:
    """Add a FULL key for the mixed-batch shape at every capture size of a
    FULL_AND_PIECEWISE dispatcher; returns how many were added (0 when the
    dispatcher is in another mode)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    if dispatcher.cudagraph_mode != CUDAGraphMode.FULL_AND_PIECEWISE:
        return 0
    sizes = dispatcher.compilation_config.cudagraph_capture_sizes or []
    added = 0
    for n in sizes:
        # The key vLLM's dispatcher builds for a non-uniform batch padded to
        # n tokens: one request per token, up to max_num_seqs.
        key = BatchDescriptor(num_tokens=n, num_reqs=min(n, max_num_seqs), uniform=False)
        if key not in dispatcher.cudagraph_keys[CUDAGraphMode.FULL]:
            dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, key)
            added += 1
    return added


class VarlenFullGraphsPatch(VllmPatch):
    """FULL CUDA graphs for depth-0 and trimmed steps (Model Runner V1, CUDA).

    Target: vllm.v1.worker.gpu_model_runner:GPUModelRunner._check_and_update_cudagraph_mode
    Why: with speculation on, FULL_AND_PIECEWISE gives FULL graphs only to
        batches of exactly 1+K tokens per request; the shorter steps our AV
        makes ran piecewise, at several times the cost of a plain step.
    How: after vLLM resolves the mode and fills its dispatcher, when our AV
        serves the engine, the mode is FULL_AND_PIECEWISE and every attention
        backend supports FULL graphs for any batch, add FULL keys for the
        mixed-batch shape at every capture size; vLLM captures and replays
        them like its own. Off with VLLM_AV_VARLEN_FULL_GRAPHS=0.
    Upstream: FULL graphs for mixed batches beside uniform-decode ones in
        FULL_AND_PIECEWISE (a "FULL_AND_FULL_DECODE" choice), or a V1 runner
        that, like Model Runner V2, sizes decode graphs by request count.
    Remove when: vLLM's V1 runner replays variable-length decode batches
        under FULL graphs by itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    attributes = ("_check_and_update_cudagraph_mode",)
    platforms = ("cuda",)

    def _check_and_update_cudagraph_mode(self, attention_backends, kv_cache_groups, *args, **kwargs):
        out = type(self)._orig__check_and_update_cudagraph_mode(
            self, attention_backends, kv_cache_groups, *args, **kwargs
        )
        options = av_options_of(self.vllm_config)
        if options is None or not options.varlen_full_graphs:
            return out
        if not backends_replay_any_batch(attention_backends, kv_cache_groups, self.vllm_config):
            logger.info(
                "vllm-av: the attention backend cannot replay mixed batches in FULL "
                "CUDA graphs; shortened steps run piecewise"
            )
            return out
        added = add_varlen_full_keys(
            self.cudagraph_dispatcher, self.vllm_config.scheduler_config.max_num_seqs
        )
        if added:
            logger.info(
                "vllm-av: FULL CUDA graphs for steps of any draft length "
                "(%d mixed-batch sizes added to the capture)", added,
            )
        return out
