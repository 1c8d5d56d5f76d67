"""Host numbers to the device without a host wait."""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(values: np.ndarray, device=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`values` on the device: into `out` (in its dtype) when given, else a
    new tensor on `device`. On CUDA staged in pinned memory (torch's caching
    host allocator keeps the block until the copy is done), then one
    asynchronous copy, which waits for nothing queued before it."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if out is not None:
        host, device = host.to(out.dtype), out.device
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
        if out is not None:
            return out.copy_(host, non_blocking=True)
        return host.to(device, non_blocking=True)
    return out.copy_(host) if out is not None else host.to(device)
