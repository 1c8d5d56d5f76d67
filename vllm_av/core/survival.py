"""Survival scores of draft slots.

Model: draft slot i of a request is accepted only if every earlier slot was
accepted, so with per-slot conditional acceptance confidences c[r, j] the
probability that slot i is reached and accepted is
    S[r, i] = prod_{j <= i} c[r, j].
S is also the expected number of tokens slot i adds to the output, which is
why the budget sizer sums it. With c in [0, 1], S is non-increasing along a
row; the selector relies on that to admit a prefix of every request.
"""

from __future__ import annotations

import numpy as np
import torch


def survival(conf):
    """Cumulative product of `conf` along the last axis: [R, K] -> [R, K].

    numpy in, numpy out; torch in, torch out (same device and dtype, no host
    sync). Confidences are expected in [0, 1]; they are not clipped here.
    """
    if isinstance(conf, torch.Tensor):
        return torch.cumprod(conf, dim=-1)
    return np.cumprod(np.asarray(conf), axis=-1)


__all__ = ["survival"]
