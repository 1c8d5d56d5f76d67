"""The target forward's attention metadata without the draft's layers.

vLLM 0.32's V1 runner builds attention metadata for every attention group
of the KV cache config each step. With a draft model whose head size
differs from the target's (Qwen2.5-Coder 0.5B's 64 against 1.5B's 128),
the draft's layers form groups of their own; the target forward never runs
them, and vLLM's drafters build the metadata their layers use from their
own groups (`SpecDecodeBaseProposer.draft_attn_groups`). So the runner's
build for those groups is work nobody reads: host time on every step, and
with FlashAttention 3 a device read (`_store_scheduler_metadata`), which
stalls the host of an async engine. The ninth H200 round counted 256 such
reads against plain decoding's 128 over 128 steps.

The runner's attention groups are rebuilt in place after vLLM measures
the CUDA graphs' memory at start-up (`profile_cudagraph_memory`, with a
KV cache of its own: `_cleanup_profiling_kv_cache` clears the same list,
`initialize_attn_backend` refills it), so what we keep is keyed on the
groups themselves, never on the list: groups kept from the profiling pass
carry builders whose persistent buffers the captured CUDA graphs do not
read.
"""

from __future__ import annotations

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

_TARGET_GROUPS_ATTR = "_vllm_av_target_attn_groups"


def _groups_key(groups) -> tuple:
    """The identity of every attention group the runner holds now. The
    cached result holds the groups it was computed from, so none of their
    ids can be reused by groups built later."""
    return tuple(tuple(id(g) for g in per_kv) for per_kv in groups)


def target_attention_groups(runner):
    """The runner's attention groups per KV cache group without those made
    of the drafter's layers alone, when our option asks for it, or None
    (option off, no such group, or a drafter without groups of its own).
    Decided once per set of attention groups the runner holds."""
    groups = getattr(runner, "attn_groups", None)
    if not groups:
        return None  # not initialised yet: ask again next time
    key = _groups_key(groups)
    cached = getattr(runner, _TARGET_GROUPS_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    options = av_options_of(runner.vllm_config)
    drafter = getattr(runner, "drafter", None)
    draft_layers = set(getattr(drafter, "_draft_attn_layer_names", None) or ())
    result = None
    # A drafter with attention groups of its own builds its layers'
    # metadata itself (vLLM's SpecDecodeBaseProposer).
    if (options is not None and options.skip_draft_layer_metadata_v1 and draft_layers
            and getattr(drafter, "draft_attn_groups", None)):
        kept = [[g for g in per_kv if not set(g.layer_names) <= draft_layers]
                for per_kv in groups]
        # Left alone: nothing to drop, or a KV cache group that would keep no
        # attention group (the draft with a KV cache group of its own).
        if sum(map(len, kept)) < sum(map(len, groups)) and all(kept):
            result = kept
    # The groups themselves are kept with the key (see _groups_key).
    setattr(runner, _TARGET_GROUPS_ATTR, (key, result, [list(p) for p in groups]))
    return result


class DraftLayerMetadataPatch(VllmPatch):
    """Build the step's attention metadata for the target's layers only.

    Target: vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata
    Why: with a draft model whose layers form attention groups of their own
        (another head size), vLLM 0.32's V1 runner builds their metadata on
        every step although only the target forward reads the runner's
        metadata and the drafter builds its own; with FlashAttention 3 each
        build also reads a value from the device.
    How: when our option `skip_draft_layer_metadata_v1` is on and the call is
        not a CUDA graph capture, call the original with the runner's
        `attn_groups` cut to groups holding a target layer
        (`target_attention_groups`: decided once per set of groups, keyed on
        the groups, since vLLM refills the same list after profiling the
        CUDA graphs' memory), restored afterwards. The draft's layers then have
        no entry in the step's per-layer metadata; the target forward does
        not run them.
    Upstream: skip drafter-only attention groups in the target's metadata
        build.
    Remove when: vLLM's V1 runner does that itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    attributes = ("_build_attention_metadata",)

    def _build_attention_metadata(self, *args, **kwargs):
        orig = type(self)._orig__build_attention_metadata
        kept = None if kwargs.get("for_cudagraph_capture") else target_attention_groups(self)
        if kept is None:
            return orig(self, *args, **kwargs)
        groups = self.attn_groups
        self.attn_groups = kept
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.attn_groups = groups
