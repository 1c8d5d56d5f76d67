"""Top-B selection of draft slots on the device (DESIGN 2.3).

Admit the `budget` valid slots with the highest CURRENT survival over the
whole batch. Ties are broken without looking at token values: higher
survival first, then earlier position, then lower request index. Slot j of
request r is valid iff j < num_drafted[r].

Why the result is a prefix per request: survival from a cumprod of
confidences in [0, 1] is non-increasing along a row, and on equal values the
earlier position wins, so slot j+1 is never ranked above slot j. We make this
hold for any input by taking a running minimum along the row first (a no-op
for a true survival), so the output is always a prefix length and always
sums to min(budget, sum(num_drafted)).

Losslessness: slot i's rank depends only on slots that outrank it, which are
other requests' slots and this request's earlier slots; none of them is a
function of draft token x_i (the survival of slot i+1 may be, but it never
outranks slot i). The budget must be stale (see budget.py).

No host sync anywhere (no .item(), .cpu(), .tolist(), no Python branch on
tensor values), so it runs inside a CUDA-graph-friendly step and under
torch.compile(fullgraph=True).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


def select_admitted(
    survival: torch.Tensor,
    num_drafted: torch.Tensor,
    budget,
) -> torch.Tensor:
    """Admitted prefix length per request: [R, K], [R], int | 0-d -> [R] int32."""
    R, K = survival.shape
    dev = survival.device
    if not isinstance(budget, torch.Tensor):
        # torch.full launches a fill kernel with the value as an argument: no
        # host-to-device copy, so no sync even from a Python int.
        budget = torch.full((), int(budget), dtype=torch.int64, device=dev)
    # NaN would compare false against everything and break the total order.
    s = torch.nan_to_num(survival.float(), nan=0.0)
    s = torch.cummin(s, dim=1).values  # [R, K], non-increasing along K
    pos = torch.arange(K, device=dev)  # [K]
    valid = pos.unsqueeze(0) < num_drafted.to(dev).unsqueeze(1)  # [R, K]
    key = torch.where(valid, s, torch.full_like(s, float("-inf")))
    # Flatten position-major (index = j * R + r): ranking equal survivals by
    # flat index orders them by earlier position, then lower request index.
    flat = key.t().reshape(-1)  # [K * R]
    if flat.is_cuda and flat.numel() <= PAIRWISE_MAX_SLOTS:
        rank = _rank_pairwise(flat)
    else:
        rank = _rank_by_sort(flat)
    selected = (rank < budget) & valid.t().reshape(-1)  # [K * R]
    return selected.view(K, R).sum(0).to(torch.int32)  # [R]


# Up to this many slots the GPU ranks by pairwise comparison: N^2 compares
# fused into one reduction kernel beat a multi-kernel radix sort at decode
# sizes (256 requests x K=7 = 1792 slots is 3.2M compares, a few us on an
# H200); past it the sort's N log N wins and memory stays linear.
PAIRWISE_MAX_SLOTS = 4096


def _rank_by_sort(flat: torch.Tensor) -> torch.Tensor:
    """Rank of each slot (0 = best): stable descending sort of the keys."""
    n = flat.numel()
    order = torch.sort(flat, dim=0, descending=True, stable=True).indices  # [N]
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(n, device=flat.device))
    return rank


def _rank_pairwise(flat: torch.Tensor) -> torch.Tensor:
    """The same ranks as `_rank_by_sort`: slot b's rank is the number of
    slots a with a higher key, or an equal key and a lower flat index."""
    n = flat.numel()
    idx = torch.arange(n, device=flat.device)
    a, b = flat.unsqueeze(1), flat.unsqueeze(0)  # [N, 1], [1, N]
    outranks = (a > b) | ((a == b) & (idx.unsqueeze(1) < idx.unsqueeze(0)))  # [N, N]
    return outranks.sum(0)  # [N]


class AdmittedLayout(NamedTuple):
    """Device-side layout of the verification forward (all int32, on device).

    num_tokens: [R] tokens each request verifies: admitted drafts + 1 (the
        last sampled token, whose logits score the first draft / the bonus).
    query_start_loc: [R + 1] exclusive prefix sum of num_tokens.
    cu_num_admitted: [R] inclusive prefix sum of admitted drafts (vLLM's
        cu_num_draft_tokens convention for the rejection sampler).
    """

    num_tokens: torch.Tensor
    query_start_loc: torch.Tensor
    cu_num_admitted: torch.Tensor


def admitted_layout(admitted: torch.Tensor) -> AdmittedLayout:
    """Cumulative token counts for a varlen verify over admitted prefixes."""
    admitted = admitted.to(torch.int32)
    num_tokens = admitted + 1  # [R]
    qsl = torch.zeros(admitted.shape[0] + 1, dtype=torch.int32, device=admitted.device)
    qsl[1:] = torch.cumsum(num_tokens, dim=0)
    cu = torch.cumsum(admitted, dim=0).to(torch.int32)
    return AdmittedLayout(num_tokens, qsl, cu)


class DevicePrefixSums:
    """Exclusive prefix sums of up to `max_len` small non-negative integer
    counts, on the device and without a host wait.

    A product with a triangular matrix of ones, not `torch.cumsum`: on the
    H200, inside a served step, each cumsum of the V2 layout showed up as a
    `cudaStreamSynchronize` in the profile. Exact while the total stays
    below 2**24 (float32 integers); a step's token counts are far below.
    """

    def __init__(self, max_len: int, device) -> None:
        # ones_upper[i, j] = 1 for i <= j: column j sums counts[0..j].
        self._ones_upper = torch.triu(torch.ones(max_len, max_len, device=device))
        self._acc = torch.zeros(max_len, device=device)

    def __call__(self, counts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Writes [0, c0, c0 + c1, ...] into out[: len(counts) + 1] and
        returns that view."""
        n = counts.shape[0]
        acc = self._acc[:n]
        torch.mv(self._ones_upper[:n, :n].t(), counts.to(acc.dtype), out=acc)
        out[:1].zero_()
        out[1 : n + 1].copy_(acc)
        return out[: n + 1]


@functools.cache
def _compiled(backend: str):
    # dynamic=False: shapes are fixed per (R, K) bucket in a CUDA-graph step,
    # and static shapes let Inductor fuse the whole selection.
    return torch.compile(select_admitted, fullgraph=True, dynamic=False, backend=backend)


def compiled_select_admitted(backend: str = "inductor"):
    """The torch.compile'd select_admitted (compiled once per process and
    backend).

    The returned callable accepts a Python int budget too; it is turned into
    a 0-d tensor before the compiled graph, so a new budget value does not
    trigger a recompile (an int would be specialised on with dynamic=False).
    Other tensors must keep their kind between calls: the graph's guards
    include each input's dispatch keys, which differ between a tensor made
    in inference mode and one made outside it.
    """
    fn = _compiled(backend)

    def call(survival: torch.Tensor, num_drafted: torch.Tensor, budget) -> torch.Tensor:
        if not isinstance(budget, torch.Tensor):
            budget = torch.full((), int(budget), dtype=torch.int64, device=survival.device)
        return fn(survival, num_drafted, budget)

    return call


__all__ = [
    "PAIRWISE_MAX_SLOTS",
    "AdmittedLayout",
    "DevicePrefixSums",
    "admitted_layout",
    "compiled_select_admitted",
    "select_admitted",
]
