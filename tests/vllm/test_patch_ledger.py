"""Every patch carries its ledger entry, and its target still exists."""

import pytest

pytest.importorskip("vllm")

from vllm_av.vllm.patching import LEDGER_FIELDS  # noqa: E402
from vllm_av.vllm.plugin import all_patches  # noqa: E402


@pytest.mark.parametrize("patch", all_patches(), ids=lambda p: p.__name__)
def test_patch_has_a_complete_ledger_entry(patch):
    doc = patch.__doc__ or ""
    missing = [f for f in LEDGER_FIELDS if f not in doc]
    assert not missing, f"{patch.__name__} docstring lacks {missing}"
    assert "0.32.0" in doc


@pytest.mark.parametrize("patch", all_patches(), ids=lambda p: p.__name__)
def test_patch_target_exists_in_installed_vllm(patch):
    target = patch.resolve_target()
    for name in patch.attributes:
        assert hasattr(target, name), f"{patch.target}.{name} no longer exists"
        # The replacement is defined on the patch class itself.
        assert name in vars(patch), f"{patch.__name__} does not define {name}"


def test_a_second_patch_on_the_same_attribute_is_refused():
    from vllm_av.vllm.patching import VllmPatch, apply_patch, revert_patch

    # Use a throwaway class as target so the real vLLM is untouched.
    import types

    mod = types.ModuleType("vllm_av_ledger_probe")
    mod.Target = type("Target", (), {"f": lambda self: 1})
    import sys

    sys.modules["vllm_av_ledger_probe"] = mod

    class P1(VllmPatch):
        target = "vllm_av_ledger_probe:Target"
        attributes = ("f",)

        def f(self):
            return 10 + type(self)._orig_f(self)

    class P2(VllmPatch):
        target = "vllm_av_ledger_probe:Target"
        attributes = ("f",)

        def f(self):
            return 0

    try:
        apply_patch(P1)
        apply_patch(P1)  # idempotent
        assert mod.Target().f() == 11
        with pytest.raises(RuntimeError, match="already patched by P1"):
            apply_patch(P2)
    finally:
        revert_patch(P1)
        sys.modules.pop("vllm_av_ledger_probe", None)
    assert mod.Target().f() == 1


def test_docs_patch_page_is_generated_from_the_ledger():
    import pathlib

    from vllm_av.vllm.ledger import render

    page = pathlib.Path(__file__).parents[2] / "docs" / "patches.md"
    assert page.read_text() == render(), (
        "docs/patches.md is stale: python -m vllm_av.vllm.ledger > docs/patches.md"
    )


def test_gpu_registration_never_imports_cpu_worker_modules():
    """Importing vllm.v1.worker.cpu_worker replaces torch.cuda streams and
    events with CPU stand-ins; a plugin that imported it on a GPU machine
    broke every engine there. Registering for CUDA must leave them alone."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, torch
        real_stream, real_event = torch.cuda.Stream, torch.Event
        import vllm_av.vllm.plugin as plugin
        plugin._device_type = lambda: "cuda"
        plugin.register()
        assert "vllm.v1.worker.cpu.shm" not in sys.modules, "cpu worker imported"
        assert torch.cuda.Stream is real_stream and torch.Event is real_event
        from vllm_av.vllm.patching import applied_patches
        assert "CPUWorkerStartupPatch" not in applied_patches()
        assert "GPUWorkerStartupPatch" in applied_patches()
        print("ok")
        """
    )
    import os

    env = dict(os.environ, VLLM_AV_IMPL="ours")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
