"""The drafter catch-up's device record under async scheduling
(vllm_av/vllm/mrv1/drafter_catch_up.py) on a GPU: skipped steps' input
tokens land at their (request, position) and come back in order, and
recording them makes no synchronizing call that torch's sync debug mode
detects (a prototype: it misses some, copies from pageable memory among
them). Needs only torch and CUDA. Negative control: the same check
catches a blocking read of a device value."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _runner(tokens: list[int], positions: list[int]):
    return SimpleNamespace(
        positions=torch.tensor(positions, dtype=torch.int64, device="cuda"),
        input_ids=SimpleNamespace(gpu=torch.tensor(tokens, dtype=torch.int32, device="cuda")))


def test_skipped_steps_are_recorded_without_a_host_sync():
    from vllm_av.vllm.mrv1.drafter_catch_up import DrafterCatchUp

    cu = DrafterCatchUp(64, record_shape=(4, 32), device="cuda")
    # Step 1 (prefills): a at 0..4, b at 0..2. Step 2+ (decodes): one each.
    cu.skipped([("a", 0, 5), ("b", 0, 3)],
               _runner([10, 11, 12, 13, 14, 20, 21, 22], [0, 1, 2, 3, 4, 0, 1, 2]))
    # The steps' device inputs exist before the check (as the runner's do).
    steps = [_runner([15 + step, 23 + step], [5 + step, 3 + step]) for step in range(6)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, runner in enumerate(steps):
            cu.skipped([("a", 5 + step, 1), ("b", 3 + step, 1)], runner)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = cu.recorded_tokens(["a", "b"], np.array([3, 4, 5, 10, 0, 8]), np.array([4, 2]))
    assert got.tolist() == [13, 14, 15, 20, 20, 28]


def test_the_sync_check_catches_a_blocking_read():
    # Negative control for the check above. (It does not flag a copy from
    # pageable host memory, which is why the record stages through pinned
    # buffers by construction rather than by this check.)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):
            torch.tensor([1, 2, 3], device="cuda").sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
