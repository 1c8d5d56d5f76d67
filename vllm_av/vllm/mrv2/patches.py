"""Model Runner V2 patches: vLLM's AV machinery, our estimator, budget,
selector and cost model.

On MRV2 (the GPU default in vLLM 0.32) vLLM already runs the whole AV step:
the drafter scores each slot, the runner sizes a budget, trims the verify
batch on the device and replays varlen decode CUDA graphs. We keep all of
that and swap the two objects that decide: the drafter's acceptance
estimator and the runner's AV manager. `enable_adaptive_verification` stays
set, so vLLM's own checks (full CUDA graphs, attention backends that accept
device-decided query lengths, no LoRA, no PP) still guard the start-up.
"""

from __future__ import annotations

import importlib
import logging

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.mrv2.catch_up import MRV2CatchUpInputsPatch
from vllm_av.vllm.mrv2.depth import MRV2DraftDepthPatch
from vllm_av.vllm.mrv2.draft_metadata import MRV2DraftLayerMetadataPatch
from vllm_av.vllm.mrv2.drafter_graphs import MRV2DraftMetadataBoundPatch, MRV2DrafterGraphsPatch
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator
from vllm_av.vllm.mrv2.manager import AVManager
from vllm_av.vllm.mrv2.ngram import MRV2NgramAVPatch
from vllm_av.vllm.mrv2.plain_step import MRV2PlainZeroDepthStepPatch
from vllm_av.vllm.mrv2.replay_bound import MRV2ReplayBoundPatch
from vllm_av.vllm.mrv2.served_warmup import MRV2ServedKernelsWarmupPatch
from vllm_av.vllm.mrv2.target_drafter import (MRV2TargetDrafterDepthPatch,
                                              MRV2TargetDrafterGraphsPatch, uses_target_drafter)
from vllm_av.vllm.mrv2.uniform_graphs import MRV2UniformDecodeGraphsPatch
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")

FACTORY = "maybe_create_adaptive_verification_manager"


def _speculative_method(vllm_config) -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "method", None)


def maybe_create_adaptive_verification_manager(**kwargs):
    """vLLM's factory contract (keyword-only arguments, a manager or None);
    ours when our options are in the config."""
    module = importlib.import_module(MRV2FactoryPatch.target)
    vllm_manager = getattr(module, f"_orig_{FACTORY}")(**kwargs)
    options = av_options_of(kwargs["vllm_config"])
    if vllm_manager is None or options is None:
        return vllm_manager
    # vLLM's factory ran its start-up checks (attention backends, varlen
    # graphs); its manager is dropped, ours takes its place.
    del vllm_manager
    rank = 0
    try:
        from vllm.distributed.parallel_state import get_tp_group

        rank = get_tp_group().rank_in_group
    except Exception:  # noqa: BLE001 - no TP group: rank 0
        pass
    method = _speculative_method(kwargs["vllm_config"])
    manager = AVManager(
        kwargs["req_states"],
        kwargs["query_start_loc"],
        kwargs["num_bonus_tokens"],
        kwargs["max_total_logits"],
        options=options,
        rank=rank,
        parallel_drafter=method in ("ngram", "ngram_gpu"),
        draft_model=method == "draft_model",
        first_forward_at_zero=uses_target_drafter(
            getattr(kwargs["vllm_config"], "speculative_config", None)),
    )
    logger.info(
        "vllm-av: adaptive verification on Model Runner V2 (K=%d, ours)",
        manager.num_speculative_steps,
    )
    return manager


class MRV2FactoryPatch(VllmPatch):
    """Build our AV manager where Model Runner V2 builds vLLM's.

    Target: vllm.v1.worker.gpu.model_runner.maybe_create_adaptive_verification_manager
    Why: vLLM 0.32's MRV2 manager sizes the verification budget with its own
        cost tables and no prior for new requests (every slot scores 1.0),
        and ranks slots with a top-k whose ties are not ordered; there is no
        seam to plug another implementation in.
    How: replace the factory name in the runner's module (the runner calls it
        by that global name in initialize_kv_cache); the replacement calls
        vLLM's factory first (its attention-backend and varlen-graph checks
        still refuse what vLLM refuses), then, when our options are in
        `additional_config["vllm_av"]`, returns `vllm_av.vllm.mrv2.manager.
        AVManager` (same methods: add_request, batches_to_profile,
        set_initial_cost_curves, set_cost_curves, record_confidences,
        get_num_tokens, compact_batch, reallocate_drafts) instead.
    Upstream: a speculative-config field or registry naming the AV manager
        class.
    Remove when: vLLM lets a plugin supply the adaptive verification manager.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.model_runner"
    attributes = (FACTORY,)
    platforms = ("cuda",)

    # A plain function on the class lands on the module as a function.
    maybe_create_adaptive_verification_manager = maybe_create_adaptive_verification_manager


class MRV2EstimatorPatch(VllmPatch):
    """Score MRV2 draft slots with our online acceptance estimator.

    Target: vllm.v1.worker.gpu.spec_decode.speculator.OnlineAcceptanceEstimator
    Why: drafters without a confidence head (draft_model, eagle, mtp, dflash)
        get their per-slot confidences from vLLM's estimator, whose fit
        (plain damped Newton every 100 steps, fixed cold-start coefficients)
        is not ours; the budget and selection are only as good as these.
    How: replace the class name the speculator module instantiates at load
        time with `vllm_av.vllm.mrv2.estimator.AcceptanceEstimator`: same
        constructor, `predict` (inside the drafter's CUDA graph: our
        logit(q_max) feature, written to fixed buffers, no sync) and `step`
        (our IRLS estimator's observe). The feature never reads the sampled
        token (DESIGN 2.5).
    Upstream: a hook for out-of-tree acceptance estimators.
    Remove when: vLLM lets a plugin supply the acceptance estimator.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.spec_decode.speculator"
    attributes = ("OnlineAcceptanceEstimator",)
    platforms = ("cuda",)

    OnlineAcceptanceEstimator = AcceptanceEstimator


MRV2_PATCHES = [MRV2EstimatorPatch, MRV2FactoryPatch, MRV2DraftDepthPatch,
                MRV2DrafterGraphsPatch, MRV2NgramAVPatch,
                MRV2UniformDecodeGraphsPatch, MRV2DraftLayerMetadataPatch,
                MRV2CatchUpInputsPatch, MRV2ReplayBoundPatch, MRV2DraftMetadataBoundPatch,
                MRV2PlainZeroDepthStepPatch, MRV2ServedKernelsWarmupPatch,
                MRV2TargetDrafterDepthPatch, MRV2TargetDrafterGraphsPatch]


def mrv2_available(device_type: str | None = None) -> bool:
    """Whether our MRV2 path can serve this process: a CUDA platform (the
    patches are CUDA-only) with the patched vLLM symbols present."""
    if device_type is None:
        try:
            from vllm.platforms import current_platform

            device_type = current_platform.device_type
        except Exception:  # noqa: BLE001
            return False
    if device_type != "cuda":
        return False
    try:
        for patch in MRV2_PATCHES:
            target = patch.resolve_target()
            if not all(hasattr(target, a) for a in patch.attributes):
                return False
    except ImportError:
        return False
    return True
