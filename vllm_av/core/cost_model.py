"""Step cost model: verification cost by token count, drafting cost by request count.

Model (DESIGN 2.4): the wall time of one engine step is
    draft_cost(num_reqs) + verify_cost(num_tokens),
each a table measured at start-up (median of a few timed dummy steps per
size). Assumptions, and how the tables are read between profiled sizes:

- Monotone: more work never costs less. Medians are forced non-decreasing
  with a running max over sizes, so timing noise cannot make the budget
  sizer think an extra token has negative cost.
- Inside the CUDA-graph captured range (n <= max graph size) a step is
  padded to the next captured size, so cost is a staircase: cost(n) is the
  cost at the smallest profiled size >= n.
- Above it (eager execution, or no graphs at all on CPU), cost is linear
  interpolation between profiled sizes and linear extrapolation beyond the
  last one using the last two points. Below the smallest profiled size the
  cost is that of the smallest (a step never costs less than the smallest
  one measured).
- A curve with a single point is constant: one measurement carries no slope
  and we do not invent one (proportional scaling would make a 1-token
  profile predict that 256 tokens cost 256x, far from the memory-bound truth).

Known weaknesses (to be beaten later): one context length, no prefill mix,
no drift correction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np


class CostCurve:
    """One monotone cost table: sizes -> ms, read as described above."""

    def __init__(self, sizes: Sequence[int], costs: Sequence[float], graph_sizes=()):
        sizes = np.asarray(sizes, dtype=np.float64)
        costs = np.asarray(costs, dtype=np.float64)
        if sizes.size == 0:
            raise ValueError("cost curve needs at least one profiled size")
        if sizes.shape != costs.shape:
            raise ValueError(f"{sizes.size} sizes but {costs.size} costs")
        if np.any(sizes <= 0) or not np.all(np.isfinite(sizes)):
            raise ValueError(f"profiled sizes must be positive, got {sizes.tolist()}")
        if np.any(costs < 0) or not np.all(np.isfinite(costs)):
            raise ValueError(f"costs must be finite and >= 0, got {costs.tolist()}")
        graph = np.asarray(sorted(set(int(g) for g in graph_sizes)), dtype=np.float64)
        if graph.size and graph[0] <= 0:
            raise ValueError(f"graph sizes must be positive, got {graph.tolist()}")
        order = np.argsort(sizes, kind="stable")
        self.sizes = sizes[order]  # [P]
        if np.unique(self.sizes).size != self.sizes.size:
            raise ValueError(f"duplicate profiled sizes: {self.sizes.tolist()}")
        self.costs = np.maximum.accumulate(costs[order])  # [P], non-decreasing
        self.graph_sizes = graph
        self.max_graph_size = float(graph[-1]) if graph.size else 0.0
        # Slope for extrapolation past the last point (0 with one point).
        if self.sizes.size >= 2:
            dx = self.sizes[-1] - self.sizes[-2]
            self._tail_slope = (self.costs[-1] - self.costs[-2]) / dx
        else:
            self._tail_slope = 0.0

        # Dense table of costs at integer sizes 0..len-1, grown on demand, so
        # the budget sizer's per-step lookups are a slice (a few us) instead
        # of an interpolation over ~2k points.
        self._table = self._evaluate(np.arange(self._initial_table_size(), dtype=np.float64))

    def _initial_table_size(self) -> int:
        return int(max(self.sizes[-1], self.max_graph_size, 1024)) + 1

    def table(self, stop: int) -> np.ndarray:
        """Costs at integer sizes 0..stop-1 (a read-only view of the cache)."""
        if stop > self._table.size:
            size = max(stop, 2 * self._table.size)
            self._table = self._evaluate(np.arange(size, dtype=np.float64))
        view = self._table[:stop]
        view.flags.writeable = False
        return view

    def __call__(self, n):
        """Cost at size n (scalar -> float, array -> float64 array)."""
        if isinstance(n, (int, np.integer)) and 0 <= n < self._table.size:
            return float(self._table[n])  # fast path for per-step scalars
        return self._evaluate(n)

    def _evaluate(self, n):
        scalar = np.ndim(n) == 0
        x = np.asarray(n, dtype=np.float64)
        xs, ys = self.sizes, self.costs
        # Linear interpolation, clamped below, extrapolated above.
        lin = np.interp(x, xs, ys)
        lin = np.where(x > xs[-1], ys[-1] + self._tail_slope * (x - xs[-1]), lin)
        if self.max_graph_size > 0:
            # Staircase inside the captured range: padded to the next profiled size.
            idx = np.searchsorted(xs, x, side="left")
            stair = ys[np.minimum(idx, xs.size - 1)]
            in_stair = (x <= self.max_graph_size) & (idx < xs.size)
            out = np.where(in_stair, stair, lin)
        else:
            out = lin
        return float(out) if scalar else out

    def to_dict(self) -> dict:
        return {
            "sizes": self.sizes.astype(int).tolist(),
            "costs": self.costs.tolist(),
            "graph_sizes": self.graph_sizes.astype(int).tolist(),
        }


def _medians(samples: Mapping[int, Iterable[float]], what: str):
    if not samples:
        raise ValueError(f"no {what} samples")
    sizes, costs = [], []
    for size, values in samples.items():
        values = np.asarray(list(values), dtype=np.float64)
        if values.size == 0:
            raise ValueError(f"{what} size {size}: empty sample list")
        if np.any(values < 0) or not np.all(np.isfinite(values)):
            raise ValueError(f"{what} size {size}: negative or non-finite time {values.tolist()}")
        if int(size) <= 0:
            raise ValueError(f"{what} sizes must be positive, got {size}")
        sizes.append(int(size))
        costs.append(float(np.median(values)))
    return sizes, costs


class CostModel:
    """Step cost = draft_cost(num_reqs) + verify_cost(num_tokens), in ms."""

    def __init__(self, verify: CostCurve, draft: CostCurve):
        self.verify = verify
        self.draft = draft

    @classmethod
    def from_samples(
        cls,
        verify: Mapping[int, Iterable[float]],
        draft: Mapping[int, Iterable[float]],
        graph_sizes: Iterable[int] = (),
        draft_graph_sizes: Iterable[int] | None = None,
    ) -> "CostModel":
        """Build from timings: `verify` token count -> ms samples, `draft`
        request count -> ms samples; medians are taken per size.

        `graph_sizes`: the CUDA-graph capture sizes of the target (empty on
        CPU / eager). `draft_graph_sizes`: the drafter's, defaulting to the
        same list (a decoding drafter runs one token per request, so its
        graphs are indexed by request count with the same capture sizes).
        """
        graph_sizes = list(graph_sizes)
        if draft_graph_sizes is None:
            draft_graph_sizes = graph_sizes
        vs, vc = _medians(verify, "verify")
        ds, dc = _medians(draft, "draft")
        return cls(CostCurve(vs, vc, graph_sizes), CostCurve(ds, dc, draft_graph_sizes))

    def verify_cost(self, num_tokens):
        """Target forward cost (ms) at `num_tokens` tokens in the step."""
        return self.verify(num_tokens)

    def verify_cost_range(self, start: int, stop: int) -> np.ndarray:
        """verify_cost(n) for integer n in [start, stop), as one slice."""
        return self.verify.table(stop)[start:]

    def draft_cost(self, num_reqs):
        """Drafting cost (ms) of one step for `num_reqs` drafting requests."""
        return self.draft(num_reqs)

    def step_cost(self, num_reqs, num_tokens):
        return self.draft_cost(num_reqs) + self.verify_cost(num_tokens)

    def to_json(self) -> str:
        return json.dumps({"verify": self.verify.to_dict(), "draft": self.draft.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        d = json.loads(text)
        return cls(
            CostCurve(d["verify"]["sizes"], d["verify"]["costs"], d["verify"]["graph_sizes"]),
            CostCurve(d["draft"]["sizes"], d["draft"]["costs"], d["draft"]["graph_sizes"]),
        )

    def summary(self) -> str:
        """One line for the start-up log."""
        v, d = self.verify, self.draft

        def ends(c: CostCurve, unit: str) -> str:
            lo, hi = c.sizes[0], c.sizes[-1]
            return f"{lo:.0f} {unit} {c.costs[0]:.3g} ms .. {hi:.0f} {unit} {c.costs[-1]:.3g} ms"

        graphs = f"graphs <= {v.max_graph_size:.0f}" if v.max_graph_size else "eager"
        return (
            f"cost model: verify {ends(v, 'tok')} ({v.sizes.size} sizes, {graphs}); "
            f"draft {ends(d, 'req')} ({d.sizes.size} sizes)"
        )


__all__ = ["CostCurve", "CostModel"]
