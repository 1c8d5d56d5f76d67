"""Find a class method named "module:Class.method", for benchmarks that
wrap vLLM's methods with timers."""
from __future__ import annotations

import importlib


def resolve_method(spec: str):
    """(class, method name, the method as the class defines it), or None
    when this vLLM has no such class or the class does not define it."""
    mod_name, attr = spec.split(":")
    cls_name, meth = attr.split(".")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError):
        return None
    orig = cls.__dict__.get(meth)
    return None if orig is None else (cls, meth, orig)
