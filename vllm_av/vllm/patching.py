"""A small, explicit way to patch vLLM classes without forking them.

Each patch is a class whose docstring is its ledger entry:

    Target: dotted path of the patched vLLM attribute(s)
    Why: what breaks or is missing without it
    How: what the replacement does
    Upstream: the vLLM change that would make the patch unnecessary
    Remove when: the condition under which to delete it
    vLLM: the version it was written against

`apply_patch` replaces the named attributes of the target class, keeps each
original on the patched class as `_orig_<name>` (so the replacement calls
through to it) and on the patch (`VllmPatch.original`), records which patch
owns which attribute, and refuses a second patch on the same attribute.
A replacement reads `type(self)._orig_<name>`, except where a subclass of
its target has `name` patched too: the subclass's original reaches it
through `super()` with `self` of the subclass, whose `_orig_<name>` is its
own original; such a replacement calls `<Patch>.original(name)`.
Tests walk `all_patches()`: every ledger entry is complete, every target
still exists in the installed vLLM, and no such pair reads `_orig_`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

LEDGER_FIELDS = ("Target:", "Why:", "How:", "Upstream:", "Remove when:", "vLLM:")


class VllmPatch:
    """Base class. Subclasses set `target` ("module:Class", or "module" for
    module-level functions) and define the replacement methods named in
    `attributes`."""

    target: str = ""
    attributes: tuple[str, ...] = ()
    # Device types (vLLM's `current_platform.device_type`) the patch is for;
    # empty: every platform. A patch for another platform is neither applied
    # nor even imported: some vLLM modules patch torch when imported (the
    # CPU worker's replaces torch.cuda streams and events with stand-ins).
    platforms: tuple[str, ...] = ()

    @classmethod
    def applies_to(cls, device_type: str) -> bool:
        return not cls.platforms or device_type in cls.platforms

    @classmethod
    def original(cls, name: str):
        """The target's `name` as it was before this patch replaced it."""
        return cls.__dict__["_originals"][name]

    @classmethod
    def resolve_target(cls) -> type:
        module_name, _, class_name = cls.target.partition(":")
        obj = importlib.import_module(module_name)
        for part in class_name.split(".") if class_name else ():
            obj = getattr(obj, part)
        return obj


@dataclass
class _Owner:
    patch: type[VllmPatch]
    original: object


# (id of target class, attribute) -> owner; one owner per attribute.
_OWNERS: dict[tuple[int, str], _Owner] = {}


def apply_patch(patch: type[VllmPatch]) -> None:
    """Apply one patch; idempotent for the same patch, an error for another."""
    target = patch.resolve_target()
    for name in patch.attributes:
        key = (id(target), name)
        owner = _OWNERS.get(key)
        if owner is not None:
            if owner.patch is patch:
                continue
            raise RuntimeError(
                f"{patch.__name__} would patch {patch.target}.{name}, "
                f"already patched by {owner.patch.__name__}"
            )
        if not hasattr(target, name):
            raise AttributeError(
                f"{patch.__name__}: {patch.target} has no attribute {name!r}; "
                "the installed vLLM differs from the one this patch targets"
            )
        original = inspect.getattr_static(target, name)
        replacement = inspect.getattr_static(patch, name)
        setattr(target, f"_orig_{name}", original)
        setattr(target, name, replacement)
        if "_originals" not in vars(patch):
            patch._originals = {}
        patch._originals[name] = original
        _OWNERS[key] = _Owner(patch, original)


def revert_patch(patch: type[VllmPatch]) -> None:
    """Undo one applied patch (tests only)."""
    for key, owner in list(_OWNERS.items()):
        if owner.patch is not patch:
            continue
        target, name = patch.resolve_target(), key[1]
        setattr(target, name, owner.original)
        if f"_orig_{name}" in vars(target):
            delattr(target, f"_orig_{name}")
        vars(patch).get("_originals", {}).pop(name, None)
        del _OWNERS[key]


def applied_patches() -> list[str]:
    return sorted({o.patch.__name__ for o in _OWNERS.values()})
