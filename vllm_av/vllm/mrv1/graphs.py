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
(FlashAttention 3 says `AttentionCGSupport.ALWAYS`) and is one validated
on a GPU (`VALIDATED_BACKENDS`), we add FULL keys for
the mixed-batch shape at every capture size once vLLM's own capture is done
(its piecewise pass must run unchanged: it also captures the drafter's
graphs, and its dummy runs check that the dispatcher still picks piecewise
for mixed batches), and capture them with vLLM's own routine. From then on
its dispatcher replays them for any batch up to the largest capture size;
the drafter keeps its piecewise graphs (it has its own dispatcher), which
cudagraph_mode FULL for the whole engine would take away.

On the H200 the start-up profile priced an 8-token target step at 8.6 ms
without it (third round) and 2.6 ms with it (fourth round; docs/RESULTS.md).
"""

from __future__ import annotations

import logging
import time

import torch

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")


# Backends whose mixed-batch FULL graphs have served on a GPU (FlashAttention
# 3 on the H200, bf16). With the float32 test pair on the H200 (FlashAttention
# does not run float32; vLLM picks Triton or Flex attention, both declaring
# ALWAYS) the engine died with an illegal memory access right after vLLM's
# capture, where ours runs (docs/RESULTS.md, fifth round); a CUDA fault
# poisons the context, so the fallback below cannot catch it.
VALIDATED_BACKENDS = ("FLASH_ATTN",)


def backends_replay_any_batch(runner) -> str | None:
    """None when every attention backend of the target can run a mixed
    batch inside a FULL CUDA graph and is one we have served with; else
    why not."""
    from vllm.v1.attention.backend import AttentionCGSupport

    groups = runner.kv_cache_config.kv_cache_groups
    for i, attn_groups in enumerate(runner.attn_groups):
        for g in attn_groups:
            spec = getattr(g, "kv_cache_spec", None) or groups[i].kv_cache_spec
            support = g.backend.get_builder_cls().get_cudagraph_support(runner.vllm_config, spec)
            if support != AttentionCGSupport.ALWAYS:
                return "the attention backend cannot replay mixed batches in FULL CUDA graphs"
            name = g.backend.get_name()
            if name not in VALIDATED_BACKENDS:
                return f"FULL graphs for mixed batches are not validated on {name}"
    return None


def add_varlen_full_keys(dispatcher) -> list:
    """Add a FULL key for the mixed-batch shape at every capture size of a
    FULL_AND_PIECEWISE dispatcher; returns the keys added, largest first
    (none when the dispatcher is in another mode)."""
    from vllm.config import CUDAGraphMode

    if dispatcher.cudagraph_mode != CUDAGraphMode.FULL_AND_PIECEWISE:
        return []
    sizes = dispatcher.compilation_config.cudagraph_capture_sizes or []
    added = []
    for n in sorted(sizes, reverse=True):
        # The key vLLM's dispatcher builds for a non-uniform batch padded to
        # n tokens (one request per token, up to max_num_seqs).
        key = dispatcher._create_padded_batch_descriptor(n, False, False)
        if key not in dispatcher.cudagraph_keys[CUDAGraphMode.FULL]:
            dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, key)
            added.append(key)
    return added


def _free_gpu_memory() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


def capture_full(runner, keys) -> None:
    """Capture FULL graphs for `keys` the way vLLM's capture_model does."""
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.config import CUDAGraphMode
    from vllm.distributed.parallel_state import graph_capture

    # vLLM forbids capture outside its capture window; open it again for ours.
    set_cudagraph_capturing_enabled(True)
    try:
        with runner._freeze_gc(), graph_capture(device=runner.device):
            runner._capture_cudagraphs(
                batch_descriptors=keys, cudagraph_runtime_mode=CUDAGraphMode.FULL
            )
    finally:
        set_cudagraph_capturing_enabled(False)


class VarlenFullGraphsPatch(VllmPatch):
    """FULL CUDA graphs for depth-0 and trimmed steps (Model Runner V1, CUDA).

    Target: vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model
    Why: with speculation on, FULL_AND_PIECEWISE gives FULL graphs only to
        batches of exactly 1+K tokens per request; the shorter steps our AV
        makes ran piecewise, at several times the cost of a plain step.
    How: after vLLM's own capture (its piecewise pass also captures the
        drafter's graphs, so it must run as it is), when our AV serves the
        engine, the mode is FULL_AND_PIECEWISE and every attention backend
        supports FULL graphs for any batch and is FlashAttention (the one
        validated on a GPU), add FULL keys for the mixed-batch
        shape at every capture size and capture them with vLLM's own capture
        routine; from then on its dispatcher picks them before the piecewise
        ones. Off with VLLM_AV_VARLEN_FULL_GRAPHS=0.
    Upstream: FULL graphs for mixed batches beside uniform-decode ones in
        FULL_AND_PIECEWISE, or a V1 runner that, like Model Runner V2, sizes
        decode graphs by request count.
    Remove when: vLLM's V1 runner replays variable-length decode batches
        under FULL graphs by itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    attributes = ("capture_model",)
    platforms = ("cuda",)

    def capture_model(self, *args, **kwargs):
        out = type(self)._orig_capture_model(self, *args, **kwargs)
        options = av_options_of(self.vllm_config)
        if options is None or not options.varlen_full_graphs:
            return out
        why_not = backends_replay_any_batch(self)
        if why_not:
            logger.info("vllm-av: %s; shortened steps run piecewise", why_not)
            return out
        keys = add_varlen_full_keys(self.cudagraph_dispatcher)
        if keys:
            t0 = time.perf_counter()
            free_before = _free_gpu_memory()
            try:
                capture_full(self, keys)
            except Exception:
                # Serve with vLLM's own graphs rather than not at all.
                from vllm.config import CUDAGraphMode

                self.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL].difference_update(keys)
                logger.warning(
                    "vllm-av: capturing FULL CUDA graphs for mixed batches failed; "
                    "shortened steps run piecewise (VLLM_AV_VARLEN_FULL_GRAPHS=0 "
                    "skips the attempt)", exc_info=True,
                )
                return out
            used = max(free_before - _free_gpu_memory(), 0)
            logger.info(
                "vllm-av: FULL CUDA graphs for steps of any draft length: %d sizes "
                "captured in %.1f s, %.2f GiB (not in vLLM's start-up memory "
                "estimate)", len(keys), time.perf_counter() - t0, used / 2**30,
            )
            if isinstance(out, int):
                out += used  # vLLM reports the graphs' memory from this
        return out
