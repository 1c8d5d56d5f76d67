"""The map from one-step-old survival rows to the next drafts' acceptance
(vllm_av/core/stale_rows.py) and its use in AdaptiveVerifier's plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_av.core.cost_model import CostModel
from vllm_av.core.stale_rows import MIN_LABELS, StaleRowCalibration, conditionals
from vllm_av.core.verifier import AdaptiveVerifier

K = 7


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p):
    return np.log(p / (1 - p))


def _outcomes(rng, n: int, intercept: float, slope: float):
    """n requests' rows (conditional logits spread around logit 0.7) and the
    outcomes of the K drafts that followed each, drawn with conditional
    acceptance sigmoid(intercept + slope * logit c_row)."""
    x = _logit(0.7) + rng.normal(0.0, 1.5, size=(n, K))
    ok = rng.random((n, K)) < _sigmoid(intercept + slope * x)
    accepted = np.where(ok.all(1), K, ok.argmin(1))  # accepted until the first rejection
    return np.cumprod(_sigmoid(x), axis=1), np.full(n, K), accepted


def _fitted(intercept: float, slope: float, seed: int, steps: int = 10,
            per_step: int = 200) -> StaleRowCalibration:
    cal = StaleRowCalibration(K)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        cal.add(*_outcomes(rng, per_step, intercept, slope))
    return cal


# Over 200 seeds (2,000 requests each) the fitted slope had a standard
# deviation of 0.028 around a true 0.4 and 0.033 around 1.0 (this file's
# `_fitted`, measured once); 0.2 is six of the larger, a false-positive
# rate below 1e-8 under a normal approximation.
TOLERANCE = 0.2


@pytest.mark.parametrize("intercept, slope", [(-0.5, 0.4), (0.0, 1.0)])
def test_the_fitted_map_recovers_how_far_rows_predict_the_next_drafts(intercept, slope):
    cal = _fitted(intercept, slope, seed=0)
    assert cal.fitted
    assert abs(cal.slope - slope) < TOLERANCE
    # The first positions carry the most labels: their intercepts are pinned.
    assert np.all(np.abs(cal.intercepts[:2] - intercept) < 2 * TOLERANCE)


def test_negative_control_rows_that_predict_fully_are_not_mistaken_for_weak_ones():
    # The slope assertion above with 0.4 fails on rows that are calibrated.
    assert abs(_fitted(0.0, 1.0, seed=0).slope - 0.4) > TOLERANCE


def test_the_map_is_the_identity_until_enough_labels():
    cal = StaleRowCalibration(K)
    rows, verified, accepted = _outcomes(np.random.default_rng(1), 8, -0.5, 0.4)
    assert 8 * K < MIN_LABELS
    cal.add(rows, verified, accepted)
    assert not cal.fitted
    assert cal.apply(rows) is rows


def test_only_verified_positions_up_to_the_first_rejection_are_labelled():
    cal = StaleRowCalibration(K)
    rows = np.tile(np.cumprod(np.full(K, 0.7)), (3, 1))
    # 2 of 5 verified accepted: 3 labels; 4 of 4: 4 labels; none verified: 0.
    cal.add(rows, np.array([5, 4, 0]), np.array([2, 4, 0]))
    assert cal.num_labels == 7
    assert list(cal._y[:7]) == [1, 1, 0, 1, 1, 1, 1]
    assert list(cal._pos[:7]) == [0, 1, 2, 0, 1, 2, 3]


def test_a_fitted_map_keeps_survival_rows_and_lowers_over_confident_ones():
    cal = _fitted(-0.5, 0.4, seed=2)
    rows = np.cumprod(np.full((2, K), 0.95), axis=1)
    mapped = cal.apply(rows)
    assert np.all(np.diff(mapped, axis=1) <= 0) and np.all(mapped > 0)
    assert np.all(mapped < rows)
    np.testing.assert_allclose(conditionals(mapped)[0, 0],
                               _sigmoid(cal.intercepts[0] + cal.slope * _logit(0.95)), rtol=1e-6)


# ----------------------------------------------------------- in the verifier

FLAT = {1: [1.0], 4096: [1.0]}


def _drive(v: AdaptiveVerifier, steps: int, seed: int):
    """Steps of 8 requests drafting K each: every step's drafts carry a
    confidence (feature) of their own, unrelated to the request's previous
    drafts; half are accepted in full, half rejected at the first slot, as
    the feature says. A stale row then says nothing of the next drafts."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(8)]
    for _ in range(steps):
        good = rng.random(8) < 0.5
        feats = torch.where(torch.from_numpy(good)[:, None], 4.0, -4.0).expand(8, K).float()
        admitted = v.admit(ids, feats.contiguous(), np.full(8, K), 8, 8, admit_all=True)
        v.begin_step()
        v.observe(ids, admitted, np.where(good, K, 0))
    return ids


def test_verifier_learns_that_stale_rows_do_not_predict_and_plans_from_what_followed():
    v = AdaptiveVerifier(K, CostModel.from_samples(FLAT, {1: [1.0]}))
    ids = _drive(v, steps=200, seed=0)
    cal = v.row_calibration
    assert cal.fitted and abs(cal.slope) < 0.2
    assert v.stats.stale_row_slope == cal.slope
    # Half the next drafts were accepted at the first position, whatever the
    # row said: planned rows sit near 0.5 there, raw ones near 0 or 1.
    raw = v._stale_rows[v._slots_of(ids)]
    planned = v.stale_scores(ids, np.full(8, K)).reshape(8, K)
    assert np.all(np.abs(raw[:, 0] - 0.5) > 0.4)
    assert np.all(np.abs(planned[:, 0] - 0.5) < 0.15)


def test_the_planning_prior_is_one_array_until_the_map_or_the_prior_changes():
    # The depth-0 memo holds while the prior it read is the same object.
    v = AdaptiveVerifier(K, CostModel.from_samples(FLAT, {1: [1.0]}))
    _drive(v, steps=200, seed=1)
    first = v._planning_prior()
    assert v._planning_prior() is first
    v.row_calibration.refit()
    assert v._planning_prior() is not first


def test_first_drafts_of_a_request_give_no_labels():
    v = AdaptiveVerifier(K, CostModel.from_samples(FLAT, {1: [1.0]}))
    ids = ["a", "b"]
    v.admit(ids, torch.full((2, K), 2.0), np.full(2, K), 2, 2, admit_all=True)
    v.begin_step()
    v.observe(ids, np.full(2, K), np.full(2, 3))
    assert v.row_calibration.num_labels == 0  # no row came before these drafts
    v.admit(ids, torch.full((2, K), 2.0), np.full(2, K), 2, 2, admit_all=True)
    v.begin_step()
    v.observe(ids, np.full(2, K), np.full(2, 3))
    assert v.row_calibration.num_labels == 2 * 4  # three accepted and the rejection, each
