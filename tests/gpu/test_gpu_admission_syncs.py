"""Admission waits for the GPU once per drafting step, with the drafted
token ids (benchmarks/admission_syncs.py: core only, no vLLM, so it runs on
any CUDA machine with torch). Counted with torch.cuda.set_sync_debug_mode.
Control: the same admission with the token ids fetched on their own must
count one more, which shows the count sees each wait."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "admission_syncs.py"


def _bench():
    spec = importlib.util.spec_from_file_location("admission_syncs", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("R", [1, 64, 256])
def test_admission_waits_once_per_step_with_the_token_ids(R):
    bench = _bench()
    together = bench.run("together", R, steps=8)
    separate = bench.run("separate", R, steps=8)
    # The first step copies the estimator's prior to the host once.
    assert together[1:] == [1] * 7, together
    assert min(separate[1:]) == 2, separate
