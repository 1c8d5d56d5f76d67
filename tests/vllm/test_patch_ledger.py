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
