"""The weight of one-step-old survival rows against the prior
(vllm_av/core/stale_rows.py) and its use in AdaptiveVerifier's plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_av.core.cost_model import CostModel
from vllm_av.core.stale_rows import MIN_LABELS, StaleRowWeight, conditionals
from vllm_av.core.verifier import AdaptiveVerifier

K = 7
PRIOR_COND = np.full(K, 0.7)
PRIOR = np.cumprod(PRIOR_COND)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p):
    return np.log(p / (1 - p))


def _outcomes(rng, n: int, true_weight: float):
    """n requests' stale rows (spread around the prior) and the outcomes of
    the K drafts that followed each, drawn with conditional acceptance
    logit(prior) + true_weight * (logit(stale) - logit(prior))."""
    z = rng.normal(0.0, 1.5, size=(n, K))
    stale_cond = _sigmoid(_logit(PRIOR_COND) + z)
    true_cond = _sigmoid(_logit(PRIOR_COND) + true_weight * z)
    # Accepted run: drafts accepted until the first rejection.
    ok = rng.random((n, K)) < true_cond
    accepted = np.where(ok.all(1), K, ok.argmin(1))
    return np.cumprod(stale_cond, axis=1), np.full(n, K), accepted


def _fitted(true_weight: float, seed: int, steps: int = 10, per_step: int = 200) -> StaleRowWeight:
    w = StaleRowWeight(K)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        stale, verified, accepted = _outcomes(rng, per_step, true_weight)
        w.add(stale, PRIOR, verified, accepted)
    return w


# Over 200 seeds the fitted weight (2,000 requests) had a standard deviation
# of 0.023 around a true 0.3 and 0.034 around 1.0 (this file's `_fitted`,
# measured once); 0.15 is 4.4 of the larger, a false-positive rate near
# 1e-5 under a normal approximation.
TOLERANCE = 0.15


@pytest.mark.parametrize("true_weight", [0.3, 1.0])
def test_the_fitted_weight_recovers_how_far_stale_rows_predict_the_next_drafts(true_weight):
    w = _fitted(true_weight, seed=0)
    assert w.fitted
    assert abs(w.weight - true_weight) < TOLERANCE


def test_negative_control_rows_that_predict_fully_are_not_mistaken_for_weak_ones():
    # The assertion above with 0.3 fails on rows that predict fully (w = 1).
    assert abs(_fitted(1.0, seed=0).weight - 0.3) > TOLERANCE


def test_weight_stays_one_and_rows_unchanged_until_enough_labels():
    w = StaleRowWeight(K)
    rng = np.random.default_rng(1)
    stale, verified, accepted = _outcomes(rng, 8, 0.3)  # at most 8 * K < MIN_LABELS labels
    assert 8 * K < MIN_LABELS
    w.add(stale, PRIOR, verified, accepted)
    assert not w.fitted and w.weight == 1.0
    rows = np.asarray(stale, dtype=np.float32)
    assert w.apply(rows, PRIOR) is rows


def test_only_verified_positions_up_to_the_first_rejection_are_labelled():
    w = StaleRowWeight(K)
    stale = np.tile(PRIOR, (3, 1))
    # 2 of 5 verified accepted: 3 labels; 4 of 4: 4 labels; none verified: 0.
    w.add(stale, PRIOR, np.array([5, 4, 0]), np.array([2, 4, 0]))
    assert w.num_labels == 7
    assert list(w._y[:7]) == [1, 1, 0, 1, 1, 1, 1]


def test_apply_moves_rows_toward_the_prior_by_the_weight():
    w = StaleRowWeight(K)
    rows = np.cumprod(np.full((2, K), 0.95), axis=1)  # confident rows
    w.weight = 0.0
    np.testing.assert_allclose(w.apply(rows, PRIOR), np.tile(PRIOR, (2, 1)), rtol=1e-6)
    w.weight = 0.5
    half = w.apply(rows, PRIOR)
    cond = conditionals(half)
    np.testing.assert_allclose(_logit(cond), 0.5 * (_logit(0.95) + _logit(0.7)), rtol=1e-6)
    assert np.all(np.diff(half, axis=1) <= 0)  # still a survival row
    assert np.all(half < rows) and np.all(half > PRIOR)


# ----------------------------------------------------------- in the verifier

FLAT = {1: [1.0], 4096: [1.0]}


def _drive(v: AdaptiveVerifier, steps: int, seed: int):
    """Steps of 8 requests drafting K each: every step's drafts carry a
    random confidence (feature) of their own, unrelated to the request's
    previous drafts; half of them are accepted in full, half rejected at
    the first slot, as the feature says. So a stale row says nothing about
    the next drafts, while the estimator's fresh predictions are sharp."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(8)]
    for _ in range(steps):
        good = rng.random(8) < 0.5
        feats = torch.where(torch.from_numpy(good)[:, None], 4.0, -4.0).expand(8, K).float()
        drafted = np.full(8, K)
        admitted = v.admit(ids, feats.contiguous(), drafted, 8, 8, admit_all=True)
        v.begin_step()
        v.observe(ids, admitted, np.where(good, K, 0))
    return ids


def test_verifier_learns_that_stale_rows_do_not_predict_and_plans_from_the_prior():
    v = AdaptiveVerifier(K, CostModel.from_samples(FLAT, {1: [1.0]}))
    ids = _drive(v, steps=200, seed=0)
    assert v.row_weight.fitted and v.row_weight.weight < 0.2
    assert v.stats.stale_row_weight == v.row_weight.weight
    # A request whose last drafts were confident is planned near the prior.
    raw = v._stale_rows[v._slots_of(ids)]
    planned = v.stale_scores(ids, np.full(8, K)).reshape(8, K)
    prior = v._prior_host()
    confident = raw[:, -1] > 0.5
    assert confident.any()
    assert np.all(np.abs(planned[confident] - prior) < np.abs(raw[confident] - prior))


def test_first_drafts_of_a_request_give_no_labels():
    v = AdaptiveVerifier(K, CostModel.from_samples(FLAT, {1: [1.0]}))
    ids = ["a", "b"]
    v.admit(ids, torch.full((2, K), 2.0), np.full(2, K), 2, 2, admit_all=True)
    v.begin_step()
    v.observe(ids, np.full(2, K), np.full(2, 3))
    assert v.row_weight.num_labels == 0  # no row came before these drafts
    v.admit(ids, torch.full((2, K), 2.0), np.full(2, K), 2, 2, admit_all=True)
    v.begin_step()
    v.observe(ids, np.full(2, K), np.full(2, 3))
    assert v.row_weight.num_labels == 2 * 4  # three accepted and the rejection, each

