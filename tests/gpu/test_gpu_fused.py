"""The fused estimator kernels on the GPU equal the torch operations they
replace: the comparison of tests/core/test_fused.py (which runs it under
Triton's interpreter on the CPU) on CUDA tensors, compiled kernels.
Core only (torch and Triton; no vLLM)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]


def _check_source() -> str:
    spec = importlib.util.spec_from_file_location("core_test_fused", ROOT / "tests/core/test_fused.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CHECK


def test_fused_kernels_on_cuda_match_the_torch_operations():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CHECK_DEVICE="cuda", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _check_source()], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    failures = json.loads(lines[-1])["failures"]
    confidences, observed = json.loads(lines[-3]), json.loads(lines[-2])
    print(json.dumps({"confidences": confidences, "observe": observed, "failures": failures}))
    assert failures == {}, failures  # the kernels ran: not torch against torch
    for row in confidences:
        # Device exp/log against torch's: a few float32 ulps of a feature <= 30.
        assert row["feature_diff"] < 1e-4 and row["confidence_diff"] < 1e-5, row
    for row in observed:
        assert row["window_diff"] <= 1e-10 * max(1.0, row["window_abs"]), row
        assert row["theta_diff"] < 1e-5 and row["totals_diff"] == 0.0, row
        assert row["refits"] == [1, 1], row
