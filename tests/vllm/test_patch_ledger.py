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


def _patches_applied_together(p1, p2) -> bool:
    """Whether two patches can be applied in one process (their platforms meet)."""
    return not p1.platforms or not p2.platforms or bool(set(p1.platforms) & set(p2.platforms))


def test_a_patched_method_that_a_patched_subclass_reaches_calls_its_own_original():
    """Where one patch replaces Base.name and another Sub.name (Sub a
    subclass of Base), Sub's original reaches Base's replacement through
    `super()`, with `self` a Sub: there `type(self)._orig_<name>` is Sub's
    original, not Base's (V2's EAGLE and MTP graph capture called the
    speculator's own capture again with the arguments of vLLM's base
    capture; the test below). Such a replacement must call
    `<Patch>.original(name)`."""
    import inspect

    patches = [(p, p.resolve_target()) for p in all_patches()]
    offenders = []
    for base_patch, base in patches:
        for sub_patch, sub in patches:
            if (base_patch is sub_patch or sub is base or not isinstance(base, type)
                    or not isinstance(sub, type) or not issubclass(sub, base)
                    or not _patches_applied_together(base_patch, sub_patch)):
                continue
            for name in set(base_patch.attributes) & set(sub_patch.attributes):
                code = "\n".join(line.split("#")[0] for line in
                                 inspect.getsource(vars(base_patch)[name]).splitlines())
                if f"type(self)._orig_{name}" in code:
                    offenders.append(f"{base_patch.__name__}.{name} (subclass patched by "
                                     f"{sub_patch.__name__})")
    assert not offenders, offenders


def _probe_hierarchy(monkeypatch):
    """A throwaway Base and Sub whose own `f` calls Base's through super()
    with fewer arguments, as vLLM's speculator graph manager calls its base
    class's capture."""
    import sys
    import types

    mod = types.ModuleType("vllm_av_hierarchy_probe")

    class Base:
        def f(self, a):
            return f"base({a})"

    class Sub(Base):
        def f(self, a, b):
            return "sub>" + super().f(a + b)

    mod.Base, mod.Sub = Base, Sub
    monkeypatch.setitem(sys.modules, "vllm_av_hierarchy_probe", mod)
    return mod


def _sub_patch():
    """A patch on the probe's Sub.f, written as our patches are."""
    from vllm_av.vllm.patching import VllmPatch

    class PatchSub(VllmPatch):
        target = "vllm_av_hierarchy_probe:Sub"
        attributes = ("f",)

        def f(self, a, b):
            return "<" + type(self)._orig_f(self, a, b) + ">"

    return PatchSub


def test_original_reaches_the_patched_class_own_original_from_a_patched_subclass(monkeypatch):
    from vllm_av.vllm.patching import VllmPatch, apply_patch, revert_patch

    mod = _probe_hierarchy(monkeypatch)

    class PatchBase(VllmPatch):
        target = "vllm_av_hierarchy_probe:Base"
        attributes = ("f",)

        def f(self, a):
            return "[" + PatchBase.original("f")(self, a) + "]"

    PatchSub = _sub_patch()

    try:
        apply_patch(PatchBase)
        apply_patch(PatchSub)
        assert mod.Sub().f("x", "y") == "<sub>[base(xy)]>"
        assert mod.Base().f("x") == "[base(x)]"
    finally:
        revert_patch(PatchSub)
        revert_patch(PatchBase)
    assert mod.Sub().f("x", "y") == "sub>base(xy)"
    assert "_originals" not in vars(PatchBase) or not PatchBase._originals


def test_type_self_orig_from_a_patched_subclass_finds_the_subclass_original(monkeypatch):
    """Negative control for the two tests above: the same base patch written
    with `type(self)._orig_f` calls Sub's original with Base's arguments."""
    from vllm_av.vllm.patching import VllmPatch, apply_patch, revert_patch

    mod = _probe_hierarchy(monkeypatch)

    class PatchBase(VllmPatch):
        target = "vllm_av_hierarchy_probe:Base"
        attributes = ("f",)

        def f(self, a):
            return "[" + type(self)._orig_f(self, a) + "]"

    PatchSub = _sub_patch()

    try:
        apply_patch(PatchBase)
        apply_patch(PatchSub)
        with pytest.raises(TypeError, match="missing 1 required positional argument"):
            mod.Sub().f("x", "y")
    finally:
        revert_patch(PatchSub)
        revert_patch(PatchBase)


def test_the_drafters_graph_capture_reaches_vllms_base_capture_with_every_patch_applied():
    """With every CUDA patch applied (registered as on a GPU machine), V2's
    EAGLE / MTP graph manager's capture (SpeculatorCudaGraphManager, patched
    by MRV2TargetDrafterGraphsPatch) reaches vLLM's base capture
    (CudaGraphManager, patched by MRV2UniformDecodeGraphsPatch) once, with
    the factory it builds. Written with `type(self)._orig_capture`, the base
    patch called the speculator's capture again with the base's two
    arguments: a TypeError at graph capture in every V2 engine with an EAGLE
    or MTP drafter under CUDA graphs. vLLM's base capture, which needs a
    GPU, is a recording stand-in here."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import types
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
        from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
            SpeculatorCudaGraphManager)
        calls = []
        def vllm_base_capture(self, create_forward_fn, progress_bar_desc="Capturing"):
            calls.append((type(self).__name__, create_forward_fn.__name__, progress_bar_desc))
        CudaGraphManager.capture = vllm_base_capture
        import vllm_av.vllm.plugin as plugin
        plugin._device_type = lambda: "cuda"
        plugin.register()
        from vllm_av.vllm.patching import applied_patches
        applied = applied_patches()
        assert {"MRV2UniformDecodeGraphsPatch", "MRV2TargetDrafterGraphsPatch"} <= set(applied)
        mgr = SpeculatorCudaGraphManager.__new__(SpeculatorCudaGraphManager)
        mgr.vllm_config = types.SimpleNamespace(additional_config={})
        mgr.decode_query_len = 1
        def forward_fn(*args, **kwargs):
            pass
        mgr.capture(forward_fn, None, None, None, [], None, "drafter graphs")
        assert calls == [("SpeculatorCudaGraphManager", "create_forward_fn", "drafter graphs")], calls
        print("ok")
        """
    )
    env = dict(os.environ, VLLM_AV_IMPL="ours", VLLM_AV_MRV2="1")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
