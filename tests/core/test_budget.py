import numpy as np

from vllm_av.core.budget import size_budget
from vllm_av.core.cost_model import CostModel


class LinearCost:
    """verify = a + b * tokens, no verify_cost_range: the generic path."""

    def __init__(self, a, b, d=0.0):
        self.a, self.b, self.d = a, b, d

    def verify_cost(self, n):
        return self.a + self.b * np.asarray(n, dtype=float)

    def draft_cost(self, n):
        return self.d * n


def _brute(scores, n_samp, t, r, cost, max_budget=None):
    s = sorted((float(x) if np.isfinite(x) else 0.0 for x in scores), reverse=True)
    n = len(s) if max_budget is None else min(len(s), max_budget)
    best, best_b = -1.0, 0
    for b in range(n + 1):
        rate = (n_samp + sum(s[:b])) / (cost.draft_cost(r) + float(cost.verify_cost(t + b)))
        if rate > best + 1e-12:
            best, best_b = rate, b
    return best_b


def _staircase_model(rng):
    graphs = sorted(set(rng.integers(1, 64, 5).tolist()))
    sizes = sorted(set(graphs + rng.integers(64, 400, 3).tolist()))
    costs = np.sort(rng.random(len(sizes)) * 3) + 0.5
    verify = {s: [c] for s, c in zip(sizes, costs)}
    return CostModel.from_samples(verify, {1: [0.2], 32: [0.4]}, graphs)


def test_budget_is_exact_argmax_on_random_instances():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(0, 60))
        scores = rng.random(n) ** rng.uniform(0.3, 3)
        if trial % 4 == 1:
            scores = scores.astype(np.float32)  # as copied off the device
        cost = _staircase_model(rng) if trial % 2 else LinearCost(1.0, rng.uniform(0.001, 0.2), 0.01)
        args = (int(rng.integers(0, 16)), int(rng.integers(0, 30)), int(rng.integers(1, 16)), cost)
        mb = int(rng.integers(0, 70)) if trial % 3 == 0 else None
        assert size_budget(scores, *args, max_budget=mb) == _brute(scores, *args, max_budget=mb)


def test_budget_stops_where_marginal_drafts_stop_paying():
    # Step cost 1 + 0.1/token: a slot pays while its survival exceeds
    # 0.1 x the current tokens-per-ms rate.
    cost = LinearCost(1.0, 0.1)
    scores = [0.9, 0.8, 0.05, 0.01]
    assert size_budget(scores, 1, 1, 1, cost) == 2
    # In the memory-bound regime (free tokens) every slot with any value pays.
    assert size_budget(scores, 1, 1, 1, LinearCost(1.0, 0.0)) == 4


def test_budget_is_order_independent_and_handles_nan():
    cost = LinearCost(1.0, 0.05)
    s = np.array([0.1, 0.9, np.nan, 0.5, 0.7])
    assert size_budget(s, 2, 2, 2, cost) == size_budget(s[::-1], 2, 2, 2, cost)
    assert size_budget(s, 2, 2, 2, cost) == _brute(s, 2, 2, 2, cost)


def test_empty_scores_and_zero_max_budget_give_zero():
    cost = LinearCost(1.0, 0.01)
    assert size_budget([], 4, 4, 0, cost) == 0
    assert size_budget(np.zeros(0), 0, 0, 0, cost) == 0
    assert size_budget([0.9, 0.9], 4, 4, 4, cost, max_budget=0) == 0
    assert size_budget([0.9, 0.9, 0.9], 4, 4, 4, cost, max_budget=2) == 2


def test_zero_survival_slots_from_requests_without_drafts_are_never_worth_it():
    cost = LinearCost(1.0, 0.01)
    assert size_budget([0.0] * 10, 4, 4, 4, cost) == 0
    assert size_budget([0.6] + [0.0] * 10, 4, 4, 4, cost) == 1
