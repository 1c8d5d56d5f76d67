"""Step cost model: verification cost by token count, drafting cost by request count.

Model (DESIGN 2.4): the wall time of one engine step is
    draft_cost(num_reqs) + verify_cost(num_tokens),
each a table measured at start-up (median of a few timed dummy steps per
size). Assumptions, and how the tables are read between profiled sizes:

- Monotone: more work never costs less. Medians are made non-decreasing
  by isotonic regression over sizes (adjacent violators pooled to their
  mean), so timing noise cannot make the budget sizer think an extra token
  has negative cost, and one slow size does not lift every size above it
  to its own cost (as a running max would).
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

Drafting cost by depth (adaptive drafting depth, `AdaptiveVerifier.choose_depth`):
the `draft` table is one drafting step at the profiled depth K (K drafter
forwards). `draft_cost_at_depth(r, d, K)` prices a shallower step:
- with a depth-resolved table (`draft_by_depth`: depth -> curve, profiled at
  a few depths), linear interpolation in depth between the profiled depths
  (and linear extrapolation past the deepest two); an autoregressive drafter
  costs about (one forward) x max(d, 1), and its depth 0 is not free: vLLM's
  drafter still runs the forward that keeps its KV cache in sync;
- without one (tables saved before depth resolution, model-free drafters,
  the simulator's tables), d/K of the K-deep table: one forward per depth,
  depth 0 free, or priced as the one forward it runs (1/K) where it keeps
  the drafter's KV cache whole (`zero_depth_forward`).
Model-free drafters (ngram, suffix) have nothing to profile: their
proposal is a host-side lookup. Their drafting cost is measured online
instead (`draft_measured`, ms per drafting step by request-count bucket)
and charged to every depth >= 1: one lookup proposes all K tokens, and a
step of depth 0 skips it.

Known weaknesses (to be beaten later): one context length, no prefill mix,
no drift correction.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np


def isotonic(y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """The non-decreasing sequence closest to y in (weighted) least squares:
    pool adjacent violators."""
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    means: list[float] = []
    mass: list[float] = []
    counts: list[int] = []
    for v, wv in zip(y, w):
        means.append(float(v))
        mass.append(float(wv))
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m = mass[-2] + mass[-1]
            means[-2] = (means[-2] * mass[-2] + means[-1] * mass[-1]) / m
            mass[-2] = m
            counts[-2] += counts[-1]
            means.pop()
            mass.pop()
            counts.pop()
    return np.repeat(means, counts)


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
        self.costs = isotonic(costs[order])  # [P], non-decreasing
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


def _nearest(by_key: Mapping[int, float], keys: np.ndarray) -> np.ndarray:
    """The value at each of `keys` (any shape) of `by_key`, or at its
    nearest key (ties: the first in `by_key`'s order)."""
    known = np.array(list(by_key))
    vals = np.array(list(by_key.values()))
    return vals[np.abs(np.asarray(keys)[..., None] - known).argmin(axis=-1)]


# A correction that moves a cost by no more than this fraction of the one
# applied is not applied. Timed steps vary by several percent from one to
# the next, so the median of the recent ones shifts a little on most timed
# steps; applying every shift bumps `version` that often and discards what
# the verifier remembers from the costs (its depth-0 choice, its
# exploration interval): a full depth search on the scheduler's path every
# few steps. A change this small moves only decisions on a knife-edge,
# where the two choices are worth nearly the same; a drift adds up until
# it is applied.
RESCALE_TOLERANCE = 0.05


def _within_tolerance(current: float | None, new: float) -> bool:
    """Whether `new` leaves `current` (None: nothing yet) as it is."""
    return current is not None and abs(float(new) - current) <= RESCALE_TOLERANCE * abs(current)


class CostModel:
    """Step cost = draft_cost(num_reqs) + verify_cost(num_tokens), in ms.

    `draft_by_depth` (optional): drafting-step curves profiled at a few
    depths, {depth: CostCurve}; see `draft_cost_at_depth`.
    """

    def __init__(
        self,
        verify: CostCurve,
        draft: CostCurve,
        draft_by_depth: Mapping[int, CostCurve] | None = None,
    ):
        self.verify = verify
        self.draft = draft
        self.draft_by_depth = dict(sorted((int(d), c) for d, c in (draft_by_depth or {}).items()))
        if any(d < 0 for d in self.draft_by_depth):
            raise ValueError(f"draft depths must be >= 0, got {list(self.draft_by_depth)}")
        # Multiplier per drafting depth learnt from measured drafting steps
        # (AdaptiveVerifier.observe_draft_time); empty: the profiled tables.
        self.draft_scale: dict[int, float] = {}
        # Whether a step of depth 0 skips the drafter (no drafting cost);
        # otherwise it pays the drafter's first forward, as profiled at depth 1.
        self.free_zero_depth = False
        # Without a depth-resolved table: whether depth 0 (not free) runs the
        # drafter's first forward, priced as depth 1 (d/K tables price it 0).
        self.zero_depth_forward = False
        # Multiplier per token-count bucket (floor(log2 n)) learnt from
        # measured steps (AdaptiveVerifier.observe_verify_time): of steps
        # that verify drafts (`verify_scale`) and of plain steps that verify
        # none (`plain_verify_scale`; the runner then skips speculative
        # metadata and the rejection sampler). Each table falls back on the
        # other's while it has none; both empty: the profiled table as it is.
        self.verify_scale: dict[int, float] = {}
        self.plain_verify_scale: dict[int, float] = {}
        # Scaled verify tables (speculative, plain), until a scale changes.
        self._scaled: dict[bool, np.ndarray] = {}
        # Measured drafting cost (ms per step) per request-count bucket
        # (floor(log2 r)) where nothing was profiled (model-free drafters;
        # AdaptiveVerifier.observe_draft_time); empty: none charged.
        self.draft_measured: dict[int, float] = {}
        # Bumped by every correction (the set_* methods), so a caller can
        # tell whether anything it computed from these costs is still valid.
        self.version = 0
        # Per-depth views (`at_depth`), valid for the costs they were made for.
        self._views: dict[tuple[int, int], DepthCost] = {}
        self._views_stamp: tuple | None = None

    def set_measured_draft_cost(self, bucket: int, ms: float) -> None:
        """The measured drafting cost of request-count bucket floor(log2 r)."""
        if _within_tolerance(self.draft_measured.get(int(bucket)), ms):
            return
        self.draft_measured[int(bucket)] = float(ms)
        self.version += 1

    def _measured_draft(self, num_reqs):
        """Measured drafting cost at `num_reqs` (each bucket its own, or the
        nearest measured bucket's); zero while nothing was measured."""
        r = np.asarray(num_reqs, dtype=np.float64)
        if not self.draft_measured:
            return np.zeros_like(r) if r.ndim else 0.0
        buckets = np.floor(np.log2(np.maximum(r, 1)))
        out = np.where(r > 0, _nearest(self.draft_measured, buckets), 0.0)
        return out if r.ndim else float(out)

    def set_verify_scale(self, bucket: int, factor: float, plain: bool = False) -> None:
        """The measured correction of token-count bucket floor(log2 n), for
        steps that verify drafts (or, `plain`, for steps that verify none)."""
        scales = self.plain_verify_scale if plain else self.verify_scale
        if _within_tolerance(scales.get(int(bucket)), factor):
            return  # keep the scaled tables and what callers derived from them
        scales[int(bucket)] = float(factor)
        self._scaled = {}
        self.version += 1

    def drop_verify_scale(self, bucket: int, plain: bool = False) -> None:
        """Forget bucket's correction (the nearest corrected bucket's then
        stands in)."""
        scales = self.plain_verify_scale if plain else self.verify_scale
        if scales.pop(int(bucket), None) is not None:
            self._scaled = {}
            self.version += 1

    def drop_draft_scale(self, depth: int) -> None:
        """Forget the correction of drafting at `depth`."""
        if self.draft_scale.pop(int(depth), None) is not None:
            self.version += 1

    def set_draft_scale(self, depth: int, factor: float) -> None:
        """The measured correction of drafting at `depth`."""
        if _within_tolerance(self.draft_scale.get(int(depth)), factor):
            return
        self.draft_scale[int(depth)] = float(factor)
        self.version += 1

    def _draft_scale(self, depth: int) -> float:
        if not self.draft_scale:
            return 1.0
        if depth in self.draft_scale:
            return self.draft_scale[depth]
        # The nearest measured depth (ties: the deeper one) stands in.
        near = min(self.draft_scale, key=lambda d: (abs(d - depth), -d))
        return self.draft_scale[near]

    @classmethod
    def from_samples(
        cls,
        verify: Mapping[int, Iterable[float]],
        draft: Mapping[int, Iterable[float]],
        graph_sizes: Iterable[int] = (),
        draft_graph_sizes: Iterable[int] | None = None,
        draft_by_depth: Mapping[int, Mapping[int, Iterable[float]]] | None = None,
    ) -> "CostModel":
        """Build from timings: `verify` token count -> ms samples, `draft`
        request count -> ms samples; medians are taken per size.

        `graph_sizes`: the CUDA-graph capture sizes of the target (empty on
        CPU / eager). `draft_graph_sizes`: the drafter's, defaulting to the
        same list (a decoding drafter runs one token per request, so its
        graphs are indexed by request count with the same capture sizes).
        `draft_by_depth`: depth -> (request count -> ms samples), drafting
        steps timed at a few depths (optional).
        """
        graph_sizes = list(graph_sizes)
        if draft_graph_sizes is None:
            draft_graph_sizes = graph_sizes
        draft_graph_sizes = list(draft_graph_sizes)
        vs, vc = _medians(verify, "verify")
        ds, dc = _medians(draft, "draft")
        by_depth = {}
        for depth, samples in (draft_by_depth or {}).items():
            s, c = _medians(samples, f"draft depth {depth}")
            by_depth[int(depth)] = CostCurve(s, c, draft_graph_sizes)
        return cls(
            CostCurve(vs, vc, graph_sizes), CostCurve(ds, dc, draft_graph_sizes), by_depth
        )

    def verify_cost(self, num_tokens, plain: bool = False):
        """Target forward cost (ms) at `num_tokens` tokens in the step (the
        step's cost apart from drafting), with its measured correction: of a
        step that verifies drafts, or (`plain`) of one that verifies none."""
        if not self._scales(plain):
            return self.verify(num_tokens)
        n = np.asarray(num_tokens)
        if n.ndim == 0 and 0 <= int(n):
            return float(self._scaled_table(int(n) + 1, plain)[int(n)])
        return self._scaled_table(int(n.max()) + 1, plain)[n.astype(np.int64)]

    def plain_verify_cost(self, num_tokens):
        """`verify_cost` of a step that verifies no draft."""
        return self.verify_cost(num_tokens, plain=True)

    @property
    def plain_differs(self) -> bool:
        """Whether plain and speculative steps are priced apart (each table
        has measurements of its own; otherwise both read the same one)."""
        return bool(self.verify_scale) and bool(self.plain_verify_scale)

    def verify_cost_range(self, start: int, stop: int, plain: bool = False) -> np.ndarray:
        """verify_cost(n, plain) for integer n in [start, stop), as one slice."""
        if not self._scales(plain):
            return self.verify.table(stop)[start:]
        return self._scaled_table(stop, plain)[start:stop]

    def _scales(self, plain: bool) -> dict[int, float]:
        own, other = ((self.plain_verify_scale, self.verify_scale) if plain
                      else (self.verify_scale, self.plain_verify_scale))
        return own or other

    def _scaled_table(self, stop: int, plain: bool = False) -> np.ndarray:
        """The profiled table times each size's bucket scale, kept monotone."""
        cached = self._scaled.get(plain)
        if cached is None or cached.size < stop:
            base = self.verify.table(max(stop, 2 * (0 if cached is None else cached.size)))
            size = base.size
            buckets = np.floor(np.log2(np.maximum(np.arange(size), 1))).astype(np.int64)
            # Each bucket takes its own scale, or the nearest measured one's.
            table = np.maximum.accumulate(base * _nearest(self._scales(plain), buckets))
            table.flags.writeable = False
            self._scaled[plain] = cached = table
        return cached

    def draft_cost(self, num_reqs):
        """Drafting cost (ms) of one step for `num_reqs` drafting requests
        (at the profiled depth K, with its measured correction if any)."""
        return (self.draft(num_reqs) * self._draft_scale(max(self.draft_scale, default=0))
                + self._measured_draft(num_reqs))

    def draft_cost_at_depth(self, num_reqs, depth: int, num_speculative_tokens: int):
        """Drafting cost (ms) of a step that drafts `depth` tokens for each of
        `num_reqs` requests, when `draft_cost` is a step at depth
        `num_speculative_tokens` (K). See the module docstring."""
        depth, K = int(depth), int(num_speculative_tokens)
        if depth == 0 and self.free_zero_depth:
            return np.zeros_like(np.asarray(num_reqs, dtype=np.float64))
        cost = self.profiled_draft_cost(num_reqs, depth, K) * self._draft_scale(depth)
        return cost + self._measured_draft(num_reqs) if depth > 0 else cost

    def profiled_draft_cost(self, num_reqs, depth: int, num_speculative_tokens: int):
        """`draft_cost_at_depth` from the profiled tables alone."""
        depth, K = int(depth), int(num_speculative_tokens)
        if depth == K:
            return self.draft(num_reqs)
        if not self.draft_by_depth:
            forwards = max(depth, 1) if self.zero_depth_forward else depth
            return self.draft(num_reqs) * (forwards / max(K, 1))
        depths = list(self.draft_by_depth)  # sorted
        if len(depths) == 1 or depth <= depths[0]:
            return self.draft_by_depth[depths[0]](num_reqs)
        # The two profiled depths around `depth` (the deepest two past the end).
        hi = next((i for i, d in enumerate(depths) if d >= depth), len(depths) - 1)
        d0, d1 = depths[hi - 1], depths[hi]
        c0, c1 = self.draft_by_depth[d0](num_reqs), self.draft_by_depth[d1](num_reqs)
        return np.maximum(c0 + (c1 - c0) * ((depth - d0) / (d1 - d0)), 0.0)

    def at_depth(self, depth: int, num_speculative_tokens: int) -> "CostModel | DepthCost":
        """This model with drafting priced at `depth` (itself at depth K).
        The views are kept while the costs stand (`version`, and whether
        depth 0 is free), so the drafting cost each one prices for a request
        count is looked up once: a depth search asks each depth's cost
        several times a step, every step a drafter drafts."""
        if int(depth) == int(num_speculative_tokens):
            return self
        stamp = (self.version, self.free_zero_depth, self.zero_depth_forward)
        if self._views_stamp != stamp:
            self._views, self._views_stamp = {}, stamp
        key = (int(depth), int(num_speculative_tokens))
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = DepthCost(self, depth, num_speculative_tokens)
        return view

    def step_cost(self, num_reqs, num_tokens):
        return self.draft_cost(num_reqs) + self.verify_cost(num_tokens)

    def to_json(self) -> str:
        d = {"verify": self.verify.to_dict(), "draft": self.draft.to_dict()}
        if self.draft_by_depth:
            d["draft_by_depth"] = {str(k): c.to_dict() for k, c in self.draft_by_depth.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        """Tables written by `to_json`, with or without `draft_by_depth`."""
        d = json.loads(text)

        def curve(c: dict) -> CostCurve:
            return CostCurve(c["sizes"], c["costs"], c["graph_sizes"])

        return cls(
            curve(d["verify"]),
            curve(d["draft"]),
            {int(k): curve(c) for k, c in d.get("draft_by_depth", {}).items()},
        )

    def summary(self) -> str:
        """One line for the start-up log."""
        v, d = self.verify, self.draft

        def ends(c: CostCurve, unit: str) -> str:
            lo, hi = c.sizes[0], c.sizes[-1]
            return f"{lo:.0f} {unit} {c.costs[0]:.3g} ms .. {hi:.0f} {unit} {c.costs[-1]:.3g} ms"

        graphs = f"graphs <= {v.max_graph_size:.0f}" if v.max_graph_size else "eager"
        depths = (
            f", depths {','.join(str(k) for k in self.draft_by_depth)}"
            if self.draft_by_depth else ""
        )
        return (
            f"cost model: verify {ends(v, 'tok')} ({v.sizes.size} sizes, {graphs}); "
            f"draft {ends(d, 'req')} ({d.sizes.size} sizes{depths})"
        )


class DepthCost:
    """A CostModel view whose drafting step is `depth` tokens deep (what
    `size_budget` reads: draft_cost, verify_cost, verify_cost_range)."""

    def __init__(self, model: CostModel, depth: int, num_speculative_tokens: int):
        self.model, self.depth, self.K = model, int(depth), int(num_speculative_tokens)
        self._draft: dict[int, float] = {}  # request count -> cost (ms); see at_depth

    def draft_cost(self, num_reqs):
        if isinstance(num_reqs, (int, np.integer)):
            cost = self._draft.get(int(num_reqs))
            if cost is None:
                cost = self._draft[int(num_reqs)] = float(
                    self.model.draft_cost_at_depth(num_reqs, self.depth, self.K))
            return cost
        return self.model.draft_cost_at_depth(num_reqs, self.depth, self.K)

    def verify_cost(self, num_tokens, plain: bool = False):
        return self.model.verify_cost(num_tokens, plain)

    def plain_verify_cost(self, num_tokens):
        return self.model.verify_cost(num_tokens, plain=True)

    @property
    def plain_differs(self) -> bool:
        return self.model.plain_differs

    def verify_cost_range(self, start: int, stop: int, plain: bool = False) -> np.ndarray:
        return self.model.verify_cost_range(start, stop, plain)


__all__ = ["CostCurve", "CostModel", "DepthCost", "isotonic"]
