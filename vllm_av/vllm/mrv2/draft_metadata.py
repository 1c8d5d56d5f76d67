"""Model Runner V2: the target step's attention metadata without the draft's
layers.

With a separate draft model (method draft_model, vLLM 0.32's
StandaloneARSpeculator) the draft's attention layers sit in the runner's KV
cache config beside the target's, and `init_attn_backend` gives them
attention groups of their own wherever their head count or KV spec differs
from the target's (Qwen2.5-Coder 0.5B's 14 heads of 64 against 1.5B's 12 of
128). `DefaultModelState.prepare_attn` builds metadata for every group it is
handed, and the runner hands it all of them, so each target step also builds
the draft groups' metadata: on the H200 a second FlashAttention build per
step. Nothing reads it. The target forward runs only its own layers; the
speculator builds its metadata with `build_attn_metadata` over groups of its
own (`DraftModelSpeculator.set_attn`: a second `init_attn_backend` for the
draft's layers, with separate AttentionGroup objects and builders), and
`StandaloneARSpeculator.propose` ignores the target's metadata it is handed.

The seam is `DefaultModelState.prepare_attn`. In vLLM 0.32 only the
target's builds call it: the runner's step (`execute_model`, real steps and
dummy runs), the capture of the target's CUDA graphs
(`prepare_inputs_to_capture`) and microbatches (`UBatchRunner.prepare`).
Every one of them then builds the same groups in the same order, so the
target's FULL graphs are captured and replayed with the same builders and
their persistent buffers. The runner's draft-group builders serve nobody
else, so leaving them unbuilt changes no buffer that anything reads.

What is built is always a subset of the groups handed in by that call
(decided once per set of group objects, which are held with the decision).
That is the lesson of the V1 version of this option
(`mrv1/draft_layer_metadata.py`), which gave wrong outputs on the H200
because it kept groups from vLLM's CUDA-graph memory profile. Here a
refilled `attn_groups` is a new key, and groups that are gone are never
built again.

A group is left out only when every one of its layers is one that vLLM
marked as the draft model's (`AttentionLayerBase.is_draft_layer`, set by
`DraftModelSpeculator.load_model` on the layers the draft model added: the
speculator's `draft_attn_layer_names`). A layer vLLM does not know counts as
the target's. A call that would keep no group at all is left whole.

What would break it: a draft_model speculator that reads the target step's
metadata for its own layers (as EAGLE-style drafters reuse it; those methods
are left alone); another reader of the step's per-layer metadata for the
draft's layers (a KV connector is handed it in `pre_forward`, so the option
does nothing when one is configured); a vLLM where the runner passes the
target's groups to something other than `prepare_attn`. A target whose model
state overrides `prepare_attn` without calling this one (Mamba hybrids)
builds every group as before.
"""

from __future__ import annotations

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

# Whether the option applies to this model state (decided on its first build:
# its config does not change).
_APPLIES_ATTR = "_vllm_av_skip_draft_metadata"
# (key, groups to build or None, the groups the key was made from).
_TARGET_GROUPS_ATTR = "_vllm_av_target_attn_groups"


def skips_draft_metadata(vllm_config) -> bool:
    """Whether a target step may leave the draft's groups out: our option
    on, a separate draft model (method draft_model) and no KV connector
    (which is handed the step's per-layer metadata)."""
    options = av_options_of(vllm_config)
    if options is None or not options.skip_draft_layer_metadata:
        return False
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "method", None) != "draft_model":
        return False
    return getattr(vllm_config, "kv_transfer_config", None) is None


def draft_layer_names(vllm_config, layer_names) -> set[str]:
    """Those of `layer_names` that vLLM marked as the draft model's."""
    layers = vllm_config.compilation_config.static_forward_context
    return {n for n in layer_names if getattr(layers.get(n), "is_draft_layer", False) is True}


def target_attention_groups(attn_groups, draft_layers: set[str]) -> list | None:
    """`attn_groups` (per KV cache group) without the groups made of draft
    layers alone, or None when that leaves out nothing or everything. A KV
    cache group may keep an empty list; vLLM's build skips it."""
    kept = [[g for g in per_kv if not (g.layer_names and set(g.layer_names) <= draft_layers)]
            for per_kv in attn_groups]
    num_kept = sum(map(len, kept))
    if num_kept == 0 or num_kept == sum(map(len, attn_groups)):
        return None
    return kept


def _groups_key(attn_groups) -> list:
    """The group objects' ids per KV cache group (list comprehensions: no
    frame of their own on Python 3.12, and this runs every step)."""
    return [[id(g) for g in per_kv] for per_kv in attn_groups]


def groups_to_build(model_state, attn_groups):
    """The groups a target build should build: `attn_groups` itself, or the
    subset of it without the draft's groups when the option applies."""
    applies = getattr(model_state, _APPLIES_ATTR, None)
    if applies is None:
        applies = skips_draft_metadata(model_state.vllm_config)
        setattr(model_state, _APPLIES_ATTR, applies)
    if not applies or not attn_groups:
        return attn_groups
    key = _groups_key(attn_groups)
    cached = getattr(model_state, _TARGET_GROUPS_ATTR, None)
    if cached is None or cached[0] != key:
        names = {n for per_kv in attn_groups for g in per_kv for n in g.layer_names}
        kept = target_attention_groups(
            attn_groups, draft_layer_names(model_state.vllm_config, names))
        # The groups are held with the key so that none of their ids can be
        # taken by groups built later (vLLM refills the runner's groups after
        # its CUDA-graph memory profile).
        cached = (key, kept, [list(per_kv) for per_kv in attn_groups])
        setattr(model_state, _TARGET_GROUPS_ATTR, cached)
    return attn_groups if cached[1] is None else cached[1]


class MRV2DraftLayerMetadataPatch(VllmPatch):
    """Build the target step's attention metadata for the target's layers only (Model Runner V2).

    Target: vllm.v1.worker.gpu.model_states.default:DefaultModelState.prepare_attn
    Why: with a draft model (method draft_model) whose layers form attention
        groups of their own, vLLM 0.32's V2 runner builds their metadata in
        every target step (on the H200 a second FlashAttention build per
        step), though the target forward never runs those layers and the
        draft-model speculator builds its metadata from groups of its own.
    How: when our option `skip_draft_layer_metadata` is on, the method is
        draft_model and no KV connector is configured, call the original
        with the groups handed in minus those whose layers vLLM marked all
        as the draft's (`is_draft_layer`). Decided once per set of groups and
        keyed on the group objects, so capture, dummy runs and steps build
        the same groups and groups replaced after the CUDA-graph memory
        profile are never built. EAGLE-style methods, which reuse the
        target's metadata, are left alone.
    Upstream: build the runner's metadata for the target's attention groups
        only when the speculator builds its own.
    Remove when: vLLM's V2 runner does that itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.model_states.default:DefaultModelState"
    attributes = ("prepare_attn",)
    platforms = ("cuda",)

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                     attn_groups, kv_cache_config, for_capture=False, ubatch_idx=0,
                     model_specific_attn_metadata=None):
        return type(self)._orig_prepare_attn(
            self, input_batch, cudagraph_mode, block_tables, slot_mappings,
            groups_to_build(self, attn_groups), kv_cache_config,
            for_capture=for_capture, ubatch_idx=ubatch_idx,
            model_specific_attn_metadata=model_specific_attn_metadata)
