"""Route vLLM's `enable_adaptive_verification` flag to our implementation."""

from __future__ import annotations

import copy
import logging
import os

from dataclasses import replace

from vllm_av.vllm.config import (
    ADDITIONAL_CONFIG_KEY,
    ENV_IMPL,
    ENV_MRV2,
    AVOptions,
    cpu_async_for_tests,
    mrv2_enabled,
)
from vllm_av.vllm.metrics import register_collector
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")

# Drafters whose draft distribution (or model-free match) we can score on
# Model Runner V1. LLM-based ones go through the proposer's draft sampling;
# ngram and suffix get a model-free feature.
MRV1_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "ngram", "suffix")


def check_supported(vllm_config) -> None:
    """Refuse, at start-up, combinations our V1-runner AV cannot serve.

    Every message names the setting to change.
    """
    spec = vllm_config.speculative_config
    method = spec.method
    if method not in MRV1_METHODS:
        raise ValueError(
            f"vllm-av: enable_adaptive_verification does not support "
            f"speculative_config.method={method!r} on Model Runner V1; use one "
            f"of {', '.join(MRV1_METHODS)} or remove enable_adaptive_verification"
        )
    if getattr(spec, "use_local_argmax_reduction", False):
        raise ValueError(
            "vllm-av: adaptive verification scores the draft distribution, "
            "which use_local_argmax_reduction never materialises; set "
            "speculative_config.use_local_argmax_reduction=false"
        )
    if vllm_config.lora_config is not None:
        raise ValueError(
            "vllm-av: adaptive verification is not supported with LoRA; "
            "remove --enable-lora or enable_adaptive_verification"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            "vllm-av: adaptive verification is not supported with pipeline "
            "parallelism; set --pipeline-parallel-size 1"
        )


# Drafters whose drafts stay on the device under async scheduling (vLLM's
# tensor path), the ones our scheduled-depth mode serves.
ASYNC_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# ... and those it serves by default, where it was measured against the
# synchronous path (a draft model on the H200); the others on request.
DEFAULT_ASYNC_METHODS = ("draft_model",)


def choose_scheduling(vllm_config, options: AVOptions) -> bool:
    """Scheduled depth (True: async scheduling; the depth is chosen when
    each step is scheduled and every draft is verified) or synchronous
    (False: depth and per-slot trimming after drafting).

    Asked for (--async-scheduling): scheduled depth, or a clear error where
    it cannot serve. Refused (--no-async-scheduling): synchronous. Left
    unset: scheduled depth where it serves in full and was measured (a
    GPU, one worker process so that the scheduler finds the verifier, a
    draft model, adaptive depth on), as vLLM itself turns async scheduling
    on for draft models; synchronous elsewhere. On the H200, ours with
    async scheduling led ours synchronous at 5 of 6 concurrencies in each
    of the ninth and tenth rounds (docs/RESULTS.md)."""
    sched = vllm_config.scheduler_config
    from vllm.platforms import current_platform

    method = vllm_config.speculative_config.method
    serves = method in ASYNC_METHODS and options.adaptive_depth
    # The CPU platform turns async scheduling off whatever the user asked
    # (vllm/platforms/cpu.py, 0.32.0), so there a request for it changes
    # nothing, unless the test switch lifts that override.
    on_cpu = current_platform.is_cpu()
    if sched.async_scheduling and (not on_cpu or cpu_async_for_tests()):
        if not serves:
            raise ValueError(
                "vllm-av: with async scheduling our AV chooses the drafting depth "
                f"when each step is scheduled, which needs adaptive depth and one of "
                f"{', '.join(ASYNC_METHODS)} (got method={method!r}, "
                f"VLLM_AV_ADAPTIVE_DEPTH={int(options.adaptive_depth)}); pass "
                "--no-async-scheduling for per-slot trimming instead"
            )
        return True
    if (sched.async_scheduling is None and not on_cpu and serves
            and method in DEFAULT_ASYNC_METHODS
            and vllm_config.parallel_config.world_size == 1
            and not vllm_config.speculative_config.disable_padded_drafter_batch):
        sched.async_scheduling = True
        return True
    # Our synchronous path hands trimmed drafts to the scheduler, which
    # needs the synchronous schedule.
    sched.async_scheduling = False
    return False


def mrv2_available() -> bool:
    from vllm_av.vllm.mrv2.patches import mrv2_available as available

    return available()


# Speculators whose drafting depth Model Runner V2 can be told each step,
# besides those fed by the target's hidden states (uses_target_drafter).
MRV2_DEPTH_METHODS = ("draft_model", "ngram", "ngram_gpu")


def mrv2_schedules_depth(spec, options) -> bool:
    """Whether Model Runner V2 chooses each step's drafting depth: adaptive
    depth on and a speculator that honours it: the draft model
    (MRV2DraftDepthPatch: any depth), ngram (MRV2NgramAVPatch: depth 0
    skips its scan; any other depth drafts all K, priced so), or EAGLE /
    single-module MTP (MRV2TargetDrafterDepthPatch: the first forward at
    every depth, then d - 1 more)."""
    from vllm_av.vllm.mrv2.target_drafter import uses_target_drafter

    return bool(options.adaptive_depth
                and (spec.method in MRV2_DEPTH_METHODS or uses_target_drafter(spec)))


def route_mrv2(vllm_config) -> None:
    """Model Runner V2: vLLM's AV machinery stays on (its own checks refuse
    what it cannot serve); our options ride to the workers, where our
    estimator and manager replace vLLM's (for ngram, MRV2NgramAVPatch gives
    V2's ngram speculator the seam it lacks)."""
    options = AVOptions.from_env().with_metrics_dir()
    spec = vllm_config.speculative_config
    # Adaptive depth on V2: chosen when scheduled, for the speculators that
    # stop at that depth (MRV2_DEPTH_METHODS).
    options = replace(options, scheduled_depth=mrv2_schedules_depth(spec, options))
    if options.test_fixed_depth >= 0:
        if not options.scheduled_depth:
            raise ValueError(
                "vllm-av: VLLM_AV_TEST_FIXED_DEPTH fixes the depth that adaptive depth "
                f"chooses on Model Runner V2, which is off here (method={spec.method!r}, "
                f"VLLM_AV_ADAPTIVE_DEPTH={int(options.adaptive_depth)}); unset it")
        logger.warning("vllm-av: VLLM_AV_TEST_FIXED_DEPTH=%d: every step drafts that "
                       "depth (a measurement control, not for service)",
                       options.test_fixed_depth)
    if options.test_lossy_admission:
        raise ValueError(
            "vllm-av: VLLM_AV_TEST_LOSSY_ADMISSION is a Model Runner V1 negative "
            "control; unset it or set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if not isinstance(vllm_config.additional_config, dict):
        raise ValueError(
            "vllm-av: --additional-config must be a dict to carry "
            "adaptive-verification options"
        )
    register_collector(options.metrics_dir)
    vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = options.to_dict()
    logger.info(
        "vllm-av: adaptive verification on Model Runner V2 (method=%s, K=%d, %s)",
        spec.method, spec.num_speculative_tokens,
        "drafting depth chosen when scheduled" if options.scheduled_depth
        else "drafting depth K" + (f" ({spec.method}: adaptive depth is for "
                                   f"{', '.join(MRV2_DEPTH_METHODS)} on Model Runner V2)"
                                   if options.adaptive_depth else ""),
    )


def prefer_v1_when_eager(vllm_config) -> None:
    """`--enforce-eager` with no runner named: Model Runner V2 serves AV only
    under FULL CUDA graphs (vLLM refuses it eager), while our V1 path runs it
    eagerly, costs profiled without graphs. Name V1 in the environment, which
    the engine's processes inherit, and say so."""
    model = getattr(vllm_config, "model_config", None)
    if (not getattr(model, "enforce_eager", False)
            or os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is not None
            or not vllm_config.use_v2_model_runner):
        return
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    logger.warning(
        "vllm-av: --enforce-eager: Model Runner V2 serves adaptive verification only "
        "with FULL CUDA graphs, so it is served on Model Runner V1, eagerly "
        "(VLLM_USE_V2_MODEL_RUNNER=1 keeps V2, where vLLM refuses it eager)")


class RouteAdaptiveVerificationPatch(VllmPatch):
    """Serve `enable_adaptive_verification` with vllm-av (Model Runner V1; V2 on CUDA).

    Target: vllm.config.vllm:VllmConfig.__post_init__
    Why: vLLM 0.32 refuses adaptive verification on Model Runner V1 (the only
        runner of the CPU backend, and the one for suffix/custom drafters on
        GPU), demands FULL CUDA graphs, and asks the attention backend for
        device-decided query lengths. Our V1 path trims drafts before they are
        scheduled, so it needs none of that.
    How: before vLLM validates the config, when the V1 runner will serve it,
        check the combination is one we support (clear error otherwise),
        record our options in `additional_config["vllm_av"]` (a plain dict
        that reaches every process) and clear the flag, so that none of
        vLLM's own AV machinery engages. On Model Runner V2 (CUDA; on unless
        VLLM_AV_MRV2=0) record our options and keep the flag: vLLM's
        AV machinery runs with our estimator and manager in it
        (vllm_av/vllm/mrv2/patches.py; ngram through MRV2NgramAVPatch);
        otherwise refuse V2 with a message naming the three ways out. With
        `--enforce-eager` and no runner named (VLLM_USE_V2_MODEL_RUNNER
        unset), serve on V1, which runs our AV eagerly, rather than let V2
        refuse it for want of FULL graphs (`prefer_v1_when_eager`).
    Upstream: a plugin seam for adaptive verification in Model Runner V1, or
        a speculative-config field naming the AV implementation.
    Remove when: vLLM accepts an out-of-tree AV implementation on every runner.
    vLLM: 0.32.0
    """

    target = "vllm.config.vllm:VllmConfig"
    attributes = ("__post_init__",)

    def __post_init__(self):
        spec = self.speculative_config
        if spec is not None and spec.enable_adaptive_verification:
            prefer_v1_when_eager(self)
            if not self.use_v2_model_runner:
                check_supported(self)
                options = AVOptions.from_env().with_metrics_dir()
                # Set by the scheduling the engine runs, never by the environment.
                options = replace(options, scheduled_depth=choose_scheduling(self, options))
                register_collector(options.metrics_dir)
                if not isinstance(self.additional_config, dict):
                    raise ValueError(
                        "vllm-av: --additional-config must be a dict to carry "
                        "adaptive-verification options"
                    )
                if options.test_fixed_depth >= 0:
                    raise ValueError(
                        "vllm-av: VLLM_AV_TEST_FIXED_DEPTH is a Model Runner V2 "
                        "measurement control; unset it or run on Model Runner V2 (CUDA)")
                self.additional_config[ADDITIONAL_CONFIG_KEY] = options.to_dict()
                spec.enable_adaptive_verification = False
                if options.test_lossy_admission:
                    logger.warning(
                        "vllm-av: VLLM_AV_TEST_LOSSY_ADMISSION is set: admission "
                        "looks at drafted tokens and the output is NOT the "
                        "target's distribution (negative control for tests)"
                    )
                logger.info(
                    "vllm-av: adaptive verification on Model Runner V1 "
                    "(method=%s, K=%d, %s)", spec.method, spec.num_speculative_tokens,
                    "async scheduling: depth chosen when scheduled, no trimming"
                    if options.scheduled_depth else "synchronous scheduling",
                )
            elif mrv2_enabled() and mrv2_available():
                route_mrv2(self)
            else:
                why = (f"{ENV_MRV2}=0" if not mrv2_enabled()
                       else "our Model Runner V2 path needs CUDA")
                raise ValueError(
                    f"vllm-av cannot serve enable_adaptive_verification on Model Runner "
                    f"V2 here ({why}): set VLLM_USE_V2_MODEL_RUNNER=0 for our AV on "
                    f"Model Runner V1, {ENV_IMPL}=vllm for vLLM's built-in AV on Model "
                    f"Runner V2, or {ENV_MRV2}=1 (the default) for our AV inside Model "
                    "Runner V2 (CUDA only)"
                )
        type(self)._orig___post_init__(self)


def without_metrics_dir(additional_config):
    """`additional_config` with our entry's `metrics_dir` left out (the same
    object when there is none to leave out)."""
    if not isinstance(additional_config, dict):
        return additional_config
    entry = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if not isinstance(entry, dict) or "metrics_dir" not in entry:
        return additional_config
    kept = {k: v for k, v in entry.items() if k != "metrics_dir"}
    return {**additional_config, ADDITIONAL_CONFIG_KEY: kept}


class ConfigHashWithoutMetricsDirPatch(VllmPatch):
    """Leave our metrics directory out of the config's hash.

    Target: vllm.config.vllm:VllmConfig.compute_hash
    Why: our options ride in `additional_config["vllm_av"]`, which vLLM
        0.32 hashes whole into the key of its torch.compile caches; their
        `metrics_dir` is a fresh temporary directory per server unless
        VLLM_AV_METRICS_DIR names one, so every start of a server with our
        AV missed the cache and compiled the target and the draft again
        (on the H200 44 s of a second engine's 154 s start, where a second
        plain engine loaded its compiled code in under a second).
    How: hash a shallow copy of the config whose `additional_config` has
        our entry without `metrics_dir`; the config itself is not touched.
        Every other option of ours stays in the hash.
    Upstream: a way to mark additional_config entries as not affecting
        the compiled graph.
    Remove when: vLLM hashes only what changes compiled code.
    vLLM: 0.32.0
    """

    target = "vllm.config.vllm:VllmConfig"
    attributes = ("compute_hash",)

    def compute_hash(self):
        orig = type(self)._orig_compute_hash
        hashed = without_metrics_dir(self.additional_config)
        if hashed is self.additional_config:
            return orig(self)
        stand_in = copy.copy(self)
        stand_in.additional_config = hashed
        return orig(stand_in)
