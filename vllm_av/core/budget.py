"""Budget sizing: how many draft slots to verify this step (CPU, numpy).

Model (DESIGN 2.2): verifying the B best draft slots yields, in expectation,
N_sampling + sum of their survival scores tokens (each sampling request emits
one correction or bonus token, plus every accepted draft), and the step costs
draft_cost(num_drafting_reqs) + verify_cost(T + B). B* maximises the ratio,
tokens per ms:

    B* = argmax_{0 <= B <= Bmax} (N_sampling + sum_{b<B} s_(b)) /
                                  (draft_cost(R) + verify_cost(T + B))

with s_(b) the scores sorted descending; at B = 0 the step verifies no
draft and is priced as a plain step (`plain_verify_cost`, where the cost
model tells the two apart). Exact: every B is evaluated at once
(sort, cumsum, one vectorised cost lookup). Assumes the scores are ONE STEP
OLD so that B does not depend on the current draft tokens (losslessness,
DESIGN 2.5); the sizer itself cannot check that. Ties go to the smaller B
(equal throughput for less work).
"""

from __future__ import annotations

import numpy as np


def size_budget(
    scores,
    num_sampling: int,
    num_other_tokens: int,
    num_drafting_reqs: int,
    cost,
    max_budget: int | None = None,
) -> int:
    """Return B*, the number of draft slots to verify this step.

    scores: 1-D array-like of stale survival scores of the scheduled draft
        slots, any order. Non-finite scores count as 0.
    num_sampling: requests that sample a token this step.
    num_other_tokens: T, the step's tokens that are not drafts.
    num_drafting_reqs: requests that drafted (indexes draft_cost).
    cost: a CostModel, or anything with draft_cost(n) and verify_cost(array)
        (verify_cost_range(start, stop) is used when present: one slice).
    max_budget: optional cap on B.
    """
    return best_budget(
        scores, num_sampling, num_other_tokens, num_drafting_reqs, cost, max_budget
    )[0]


def best_budget(
    scores,
    num_sampling: int,
    num_other_tokens: int,
    num_drafting_reqs: int,
    cost,
    max_budget: int | None = None,
) -> tuple[int, float]:
    """`size_budget`, and the expected rate (tokens per ms) at B*: what
    `AdaptiveVerifier.choose_depth` compares across drafting depths."""
    s = np.asarray(scores).ravel()  # [N]
    # Survival scores come off the device as float32; sorting them in float32
    # is ~2x faster than float64 (SIMD sort) and exact for the values given.
    # Sums are always accumulated in float64.
    if s.dtype != np.float32:
        s = s.astype(np.float64, copy=False)
    n = s.size
    if max_budget is not None:
        n = min(n, max(int(max_budget), 0))
    if n == 0:
        step = cost.draft_cost(int(num_drafting_reqs)) + _plain_cost(cost, int(num_other_tokens))
        return 0, num_sampling / max(float(step), 1e-12)
    if not np.isfinite(s).all():
        s = np.where(np.isfinite(s), s, 0.0)
    # Only the n largest matter; a full sort of ~2k floats is a few us.
    top = np.sort(s)[::-1][:n]  # [n], descending (a view, no copy)
    gain = np.empty(n + 1)  # [n + 1], expected tokens for B = 0..n
    gain[0] = 0.0
    np.cumsum(top, out=gain[1:], dtype=np.float64)
    gain += num_sampling
    t = int(num_other_tokens)
    if hasattr(cost, "verify_cost_range"):
        verify = cost.verify_cost_range(t, t + n + 1)  # [n + 1], B = 0..n
    else:
        verify = cost.verify_cost(t + np.arange(n + 1))
    if getattr(cost, "plain_differs", False):
        verify = verify.copy()  # the range may be a read-only view of a table
        verify[0] = cost.plain_verify_cost(t)
    step_cost = cost.draft_cost(int(num_drafting_reqs)) + verify
    # Guard against a zero-cost table (division by zero would give nan/inf).
    rate = gain / np.maximum(step_cost, 1e-12)
    b = int(np.argmax(rate))
    return b, float(rate[b])


def best_depth(
    rows,
    num_sampling: int,
    num_other_tokens: int,
    draft_costs,
    cost,
    entry_margin: float = 0.0,
) -> tuple[int, float]:
    """The drafting depth d in 0..D (D = len(draft_costs) - 1) whose budget
    reaches the best rate: `best_budget` with the first d columns of `rows`
    [R, >= D] as the scores and draft_costs[d] as the drafting step, ties to
    the shallower depth. Every depth at once, from one sort: the slots of
    depth d are those of column < d, in the same descending order, so depth
    d's gain for B slots is the running sum over the sorted list with the
    deeper columns zeroed, read where its B-th slot falls. A depth above 0
    must beat depth 0's rate by the factor 1 + `entry_margin`, else depth 0
    is chosen. Returns (d, rate).
    """
    rows = np.asarray(rows)
    D = len(draft_costs) - 1
    R = rows.shape[0]
    draft = np.asarray(draft_costs, dtype=np.float64)  # [D + 1]
    t = int(num_other_tokens)
    plain = _plain_cost(cost, t)
    # B = 0 at each depth: drafted (or not), nothing verified.
    rate0 = num_sampling / np.maximum(draft + plain, 1e-12)  # [D + 1]
    n = R * D
    if n == 0:
        d = int(np.argmax(rate0))
        return d, float(rate0[d])
    s = rows[:, :D]
    s = s if s.dtype == np.float32 else s.astype(np.float64, copy=False)
    if not np.isfinite(s).all():
        s = np.where(np.isfinite(s), s, 0.0)
    flat = s.ravel()  # row-major: slot i is column i % D
    # Equal scores may come in any order: the sums they make do not change.
    order = np.argsort(-flat)  # [n], best first
    top = flat[order].astype(np.float64)
    col = order % D
    depths = np.arange(1, D + 1)[:, None]  # [D, 1]
    inside = col[None, :] < depths  # [D, n]: the slot is drafted at that depth
    gain = np.cumsum(inside * top, axis=1)  # [D, n]; deeper slots add exactly 0
    gain += num_sampling
    count = np.cumsum(inside, axis=1, dtype=np.int32)  # [D, n]: B where the slot is the B-th
    if hasattr(cost, "verify_cost_range"):
        verify = cost.verify_cost_range(t, t + n + 1)  # [n + 1], B = 0..n
    else:
        verify = cost.verify_cost(t + np.arange(n + 1))
    step = verify[count]
    step += draft[1:, None]
    rate = gain / np.maximum(step, 1e-12, out=step)
    rate[~inside] = -np.inf
    # Per depth, B = 0 first, then B = 1..: the first maximum is the smallest B.
    best = np.maximum(rate0[1:], rate.max(axis=1))  # [D]
    per_depth = np.concatenate([rate0[:1], best])  # [D + 1]
    d = int(np.argmax(per_depth))
    if d > 0 and per_depth[d] < per_depth[0] * (1.0 + entry_margin):
        d = 0
    return d, float(per_depth[d])


def _plain_cost(cost, num_tokens: int) -> float:
    """Cost of a step that verifies no draft (a plain step)."""
    if getattr(cost, "plain_differs", False):
        return float(cost.plain_verify_cost(num_tokens))
    return float(cost.verify_cost(num_tokens))


__all__ = ["best_budget", "best_depth", "size_budget"]
