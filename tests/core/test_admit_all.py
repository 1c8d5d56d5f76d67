"""`AdaptiveVerifier.admit(admit_all=True)` (async scheduling: every drafted
slot was scheduled, so every one is verified): the same learning as an
admission whose budget admits everything, with the host copies deferred."""

from __future__ import annotations

import numpy as np
import torch

from vllm_av.core.cost_model import CostModel
from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.verifier import AdaptiveVerifier

K = 5
STEPS = 30


def _verifier(selector=None) -> AdaptiveVerifier:
    cost = CostModel.from_samples({1: [1.0], 4096: [1.0]}, {1: [0.0]})
    return AdaptiveVerifier(K, cost, OnlineAcceptanceEstimator(K, refit_interval=4),
                            selector=selector)


def _admit_everything(surv, num_drafted, budget):
    return num_drafted.clone()


def _run(v: AdaptiveVerifier, admit_all: bool, seed: int = 0):
    """Drafting steps with changing batches; outcomes from a fixed rule."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    live = [f"r{i}" for i in range(6)]
    next_id = 6
    admitted_log = []
    for step in range(STEPS):
        v.begin_step()
        if step:
            # Outcomes of last step's drafts: accepted counts drawn at random.
            verified = np.full(len(prev_ids), K)
            accepted = rng.integers(0, K + 1, size=len(prev_ids))
            v.observe(prev_ids, verified, accepted)
        if step % 7 == 3:  # a request finishes, a new one arrives
            gone = live.pop(0)
            v.forget([gone])
            live.append(f"r{next_id}")
            next_id += 1
        feats = torch.rand(len(live), K)
        num_drafted = np.full(len(live), K)
        admitted = v.admit(list(live), feats, num_drafted, num_sampling=len(live),
                           num_other_tokens=len(live), admit_all=admit_all)
        admitted_log.append(admitted.tolist())
        prev_ids = list(live)
    v.begin_step()
    return admitted_log


def test_admit_all_learns_exactly_as_a_budget_that_admits_everything():
    a, b = _verifier(), _verifier(selector=_admit_everything)
    log_a, log_b = _run(a, admit_all=True), _run(b, admit_all=False)
    assert log_a == log_b == [[K] * 6] * STEPS
    ids = [f"r{i}" for i in range(6, 10)]
    np.testing.assert_array_equal(a.stale_scores(ids, np.full(4, K)),
                                  b.stale_scores(ids, np.full(4, K)))
    for name in ("verified", "accepted", "admitted", "drafted", "trimmed"):
        assert getattr(a.stats, name) == getattr(b.stats, name), name
    np.testing.assert_array_equal(a.stats.labelled, b.stats.labelled)
    np.testing.assert_allclose(a.stats.predicted, b.stats.predicted)
    assert a.stats.trimmed == 0 and a.stats.verified > 0


def test_nothing_is_left_deferred_once_outcomes_are_observed():
    v = _verifier()
    v.admit(["x", "y"], torch.rand(2, K), np.array([K, K]), 2, 2, admit_all=True)
    assert len(v._deferred) == 1
    v.begin_step()
    assert v._deferred == []
    # The pending predictions reached the set being verified.
    assert v._verifying.conf[v._slots_of(["x", "y"])].max() > 0
