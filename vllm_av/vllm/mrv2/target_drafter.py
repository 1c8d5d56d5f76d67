"""Adaptive drafting depth for drafters fed by the target's hidden states
(EAGLE, EAGLE-3, single-module MTP) on Model Runner V2.

These speculators (vLLM 0.32's `TargetDependentARSpeculator`) already
honour the depth the runner passes them, for vLLM's dynamic speculative
decoding: the first forward runs over the step's accepted tokens at every
depth (it writes the drafter's KV cache and needs the target's hidden
states of those very tokens, so it cannot be skipped and caught up later),
then d - 1 decode forwards. Two things stop adaptive depth from using that
as it stands:
- the slots past depth d keep an older step's confidences, which our
  manager would record and the next budget and depth choice would read;
- under FULL CUDA graphs the fused decode loop is captured for K steps
  only, unless a dynamic-SD schedule is configured, and at depth d < K the
  runner replays that K-step graph: the forwards past d still run.

`MRV2TargetDrafterDepthPatch` gives the undrafted slots the estimator's
prior, tells our manager that a depth-0 step drafted nothing (so it
records nothing), and times the start-up profile's depth-1 dummy runs at
depth 1. `MRV2TargetDrafterGraphsPatch` captures the fused decode loop once
per depth 2..K, as vLLM does for a dynamic-SD schedule. The depth itself
is chosen by the same policy as for draft models (depth.py), with depth 0
priced as the first forward (`AVManager.first_forward_at_zero`).
Nothing here reads a drafted token (DESIGN 2.5).
"""

from __future__ import annotations

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.mrv2.depth import (depth_options, note_propose, prior_for_undrafted,
                                     profile_depth)
from vllm_av.vllm.patching import VllmPatch

# Speculative methods whose V2 speculator is a TargetDependentARSpeculator
# (multi-module MTP, more than one MTP layer in use, has its own).
TARGET_DRAFTER_METHODS = ("eagle", "eagle3", "mtp")


def uses_target_drafter(spec) -> bool:
    """Whether `spec` (vLLM's SpeculativeConfig) drafts with a speculator
    fed by the target's hidden states that stops at the depth it is given."""
    if spec is None or getattr(spec, "method", None) not in TARGET_DRAFTER_METHODS:
        return False
    multi = getattr(spec, "use_multi_module_mtp", None)
    return not (callable(multi) and multi())


def depths_to_capture(num_speculative_steps: int) -> list[int]:
    """The depths whose fused decode loop gets graphs of its own: every
    depth with a decode forward (depth 0 and 1 run the first forward only),
    deepest first."""
    return list(range(int(num_speculative_steps), 1, -1))


def per_depth_descriptors(descs, depths, descriptor_cls) -> list:
    """One `descriptor_cls` per (size, depth), deepest first per size; a
    list already made so (a second capture) gives the same list."""
    out, seen = [], set()
    for desc in descs:
        fields = {k: v for k, v in vars(desc).items() if k != "num_speculative_tokens"}
        for d in depths:
            made = descriptor_cls(**fields, num_speculative_tokens=d)
            if made not in seen:
                seen.add(made)
                out.append(made)
    return out


class MRV2TargetDrafterDepthPatch(VllmPatch):
    """Keep EAGLE / MTP drafting at the scheduled depth consistent with our
    manager and cost profile.

    Target: vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator:TargetDependentARSpeculator.propose
    Why: vLLM 0.32's EAGLE and MTP speculators stop at the depth the runner
        passes (dynamic speculative decoding), but leave an older step's
        confidences in the slots past it, which our manager records and the
        next budget and depth choice would read; dummy runs always draft K,
        so the drafter's cost at depth 1 could not be profiled.
    How: with our adaptive depth on, after vLLM's propose at depth d < K:
        d = 0 notes the drafter as having drafted nothing (our manager then
        records nothing: nothing is verified), d >= 1 gives slots d..K-1 the
        estimator's prior (device copy, no sync). The start-up profile's
        dummy runs at depth 1 (`set_profile_depth`) are run at that depth.
        Everything else runs unchanged.
    Upstream: a speculator that resets the confidences of the slots it did
        not draft.
    Remove when: vLLM's V2 speculators leave no stale confidences past the
        depth and take a depth in dummy runs.
    vLLM: 0.32.0
    """

    target = ("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator:"
              "TargetDependentARSpeculator")
    attributes = ("propose",)
    platforms = ("cuda",)

    def propose(self, input_batch, *args, **kwargs):
        orig = type(self)._orig_propose
        note_propose(False)
        if not depth_options(self)[0]:  # our adaptive depth off
            return orig(self, input_batch, *args, **kwargs)
        K = self.num_speculative_steps
        if kwargs.get("dummy_run"):
            at_depth = profile_depth()
            if at_depth is not None and at_depth < K:
                kwargs["num_speculative_tokens"] = at_depth
            return orig(self, input_batch, *args, **kwargs)
        drafts = orig(self, input_batch, *args, **kwargs)
        depth = kwargs.get("num_speculative_tokens")
        if depth is not None and depth < K:
            if depth <= 0:
                note_propose(True)
            else:
                prior_for_undrafted(self, input_batch.num_reqs, int(depth))
        return drafts


class MRV2TargetDrafterGraphsPatch(VllmPatch):
    """Capture EAGLE / MTP's fused decode loop once per drafting depth.

    Target: vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils:SpeculatorCudaGraphManager.capture
    Why: vLLM 0.32 captures the fused multi-step decode loop for K steps
        unless a dynamic-SD schedule is configured; at a depth d < K the
        runner then replays the K-step graph, so adaptive depth would pay
        the forwards it saves.
    How: with our adaptive depth on, for the decode loop's manager
        (decode_query_len 1) capturing `_generate_fused_drafts` without
        vLLM's specialization, the descriptors to capture become one per
        depth 2..K (`depths_to_capture`), the same descriptor type vLLM's
        runtime lookup (`specialize_spec_tokens`) asks for; vLLM's capture
        then passes each its depth. Prefill graphs and unfused per-step
        decode graphs are captured unchanged.
    Upstream: specialise the decode graphs by depth whenever the runner may
        pass a depth below K.
    Remove when: vLLM captures a graph per depth for any adaptive depth.
    vLLM: 0.32.0
    """

    target = ("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils:"
              "SpeculatorCudaGraphManager")
    attributes = ("capture",)
    platforms = ("cuda",)

    def capture(self, forward_fn, *args, specialize_spec_tokens: bool = False, **kwargs):
        orig = type(self)._orig_capture
        fused = getattr(forward_fn, "__name__", "") == "_generate_fused_drafts"
        options = av_options_of(self.vllm_config)
        if (specialize_spec_tokens or not fused or self.decode_query_len != 1
                or options is None or not options.scheduled_depth):
            return orig(self, forward_fn, *args,
                        specialize_spec_tokens=specialize_spec_tokens, **kwargs)
        from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
            SpeculatorBatchDescriptor)

        depths = depths_to_capture(self.vllm_config.num_speculative_tokens)
        self._capture_descs = {
            mode: per_depth_descriptors(descs, depths, SpeculatorBatchDescriptor)
            for mode, descs in self._capture_descs.items()
        }
        return orig(self, forward_fn, *args, specialize_spec_tokens=False, **kwargs)
