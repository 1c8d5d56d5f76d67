"""Run a script with Triton kernels under Triton's interpreter (CPU tensors).

A subprocess: TRITON_INTERPRET must be set before Triton defines the
kernels. Returns the script's stdout lines; a failing script fails the
caller with the end of its stderr.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: int = 600) -> list[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()
