"""The core must stay engine-agnostic: nothing under vllm_av/core imports vllm."""

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[2] / "vllm_av" / "core"


def _imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_no_core_module_imports_vllm():
    files = sorted(CORE.rglob("*.py"))
    assert files, f"no modules found under {CORE}"
    offenders = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in _imported_modules(tree):
            if name == "vllm" or name.startswith("vllm."):
                offenders.append(f"{path.name}: import {name}")
    assert not offenders, offenders


def test_importing_core_does_not_load_vllm():
    code = "import sys, vllm_av.core; print('vllm' in sys.modules)"
    root = CORE.parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
