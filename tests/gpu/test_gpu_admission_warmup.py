"""The MRV2 manager's admission warm-up on a GPU (`AVManager._warm_admission`):
after it, the first served step whose budget trims drafts compiles nothing,
with the selector compiled by inductor as served. The manager needs no
vLLM, so this runs on any CUDA machine with torch and Triton. Negative
control: the warm-up before it (the selector alone, on fresh tensors made
in inference mode) leaves a recompile to that step, which the count
must see. The CPU test with Dynamo's eager backend:
tests/vllm/test_mrv2.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mrv2_fakes import K, first_trimmed_step, make_manager  # noqa: E402


@pytest.mark.parametrize("warm, recompiles", [("admission", False), ("fresh_tensors", True)])
def test_first_trimmed_step_on_cuda_compiles_nothing_after_the_admission_warm_up(
        warm, recompiles):
    torch._dynamo.reset()
    try:
        ids = ["a", "b", "c"]
        m = make_manager(ids, device="cuda")  # the served selector: inductor on CUDA
        budget, admitted, want, warm_graphs, step_graphs = first_trimmed_step(m, ids, warm)
        torch.cuda.synchronize()
        assert warm_graphs >= 1
        assert 0 < budget < 3 * K  # trimmed: the device admission ran
        np.testing.assert_array_equal(admitted, want)
        assert (step_graphs > 0) == recompiles, (warm, step_graphs)
    finally:
        torch._dynamo.reset()
