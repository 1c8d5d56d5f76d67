"""A step that verifies no draft runs as plain decoding (Model Runner V1).

With a drafter configured, vLLM 0.32's V1 runner treats every step as a
speculative one: it builds spec-decode metadata (index arithmetic and five
host-to-device copies) and samples through the rejection sampler, even when
no request carries a draft. Under adaptive depth most steps at high load
are such steps, and on a GPU at small batch that host work and those extra
launches are a visible share of a step. A step with no scheduled draft is a
plain decoding step in all but name, so we let the runner prepare it as one.
"""

from __future__ import annotations

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.patching import VllmPatch

_ENABLED_ATTR = "_vllm_av_plain_steps"


def _layer_specs(group_spec):
    """The per-layer specs of a KV cache group: vLLM wraps layers of one
    type but different page sizes (a draft model whose head size differs
    from the target's, as Qwen2.5-Coder 0.5B's does from 1.5B's) in a
    UniformTypeKVCacheSpecs that is no AttentionSpec itself."""
    inner = getattr(group_spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [group_spec]


def _attention_only(kv_cache_config) -> bool:
    """Recurrent (Mamba-style) layers read their state at an offset only the
    speculative path applies, so vLLM keeps their zero-draft decode rows on
    that path; we leave such models alone."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    specs = [s for g in kv_cache_config.kv_cache_groups for s in _layer_specs(g.kv_cache_spec)]
    return bool(specs) and all(isinstance(s, AttentionSpec) for s in specs)


def schedules_no_draft(scheduler_output) -> bool:
    """Whether a step verifies no draft (False when the scheduler output
    does not say)."""
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    return spec is not None and not any(spec.values())


def plain_steps_enabled(runner) -> bool:
    """Decided once per runner, after its KV cache layout is known."""
    enabled = getattr(runner, _ENABLED_ATTR, None)
    if enabled is None:
        kv_cache_config = getattr(runner, "kv_cache_config", None)
        if kv_cache_config is None:
            return False
        options = av_options_of(runner.vllm_config)
        enabled = (options is not None and options.plain_zero_draft_steps
                   and runner.speculative_config is not None
                   and _attention_only(kv_cache_config))
        setattr(runner, _ENABLED_ATTR, enabled)
    return enabled


def runs_plain(runner, scheduler_output) -> bool:
    """Whether a step runs as plain decoding: it verifies no draft and
    PlainZeroDraftStepPatch prepares such steps without speculative
    metadata (its time then corrects the plain verification table)."""
    return schedules_no_draft(scheduler_output) and plain_steps_enabled(runner)


class PlainZeroDraftStepPatch(VllmPatch):
    """Prepare a step that verifies no draft as a plain decoding step.

    Target: vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs
    Why: vLLM 0.32's V1 runner builds spec-decode metadata and runs its
        rejection sampler on every step once a drafter is configured, drafts
        or none; steps of drafting depth 0 (most steps at high load under
        our adaptive depth) pay for verification that verifies nothing.
    How: when our AV serves the runner, the model is attention-only and the
        scheduler output carries no draft token, call the original with the
        runner's `speculative_config` set to None for the call, so it
        returns vLLM's no-speculation result (logits at each request's last
        token, no metadata); the step then samples with the plain sampler,
        and a drafter called after it takes its no-metadata path (input up
        to the last scheduled token). The sampled tokens and the
        distribution are those of the speculative path with zero drafts:
        target-only sampling either way.
    Upstream: skip spec-decode metadata and the rejection sampler when a
        step schedules no draft.
    Remove when: vLLM's V1 runner does that itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    attributes = ("_prepare_inputs",)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        orig = type(self)._orig__prepare_inputs
        if not runs_plain(self, scheduler_output):
            return orig(self, scheduler_output, *args, **kwargs)
        spec_config = self.speculative_config
        self.speculative_config = None
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec_config
