import itertools

import numpy as np

from vllm_av.core.metrics import (
    expected_calibration_error,
    log_loss,
    reliability_bins,
    roc_auc,
)


def _auc_brute(s, y):
    pos, neg = s[y == 1], s[y == 0]
    total = 0.0
    for a, b in itertools.product(pos, neg):
        total += 1.0 if a > b else 0.5 if a == b else 0.0
    return total / (len(pos) * len(neg))


def test_roc_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = rng.integers(2, 60)
        s = rng.integers(0, 5, n).astype(float)  # many ties
        y = rng.integers(0, 2, n)
        if y.min() == y.max():
            continue
        assert abs(roc_auc(s, y) - _auc_brute(s, y)) < 1e-12


def test_roc_auc_known_values():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5
    assert np.isnan(roc_auc([0.5, 0.6], [1, 1]))


def test_log_loss_known_values_and_clipping():
    assert abs(log_loss([0.5, 0.5], [0, 1]) - np.log(2)) < 1e-12
    assert abs(log_loss([0.8], [1]) + np.log(0.8)) < 1e-12
    assert np.isfinite(log_loss([0.0, 1.0], [1, 0]))


def test_ece_and_reliability_bins_brute_force():
    rng = np.random.default_rng(1)
    p = rng.random(500)
    y = (rng.random(500) < p**2).astype(float)
    bins = reliability_bins(p, y, num_bins=5)
    ece = 0.0
    for b in range(5):
        lo, hi = b / 5, (b + 1) / 5
        m = (p >= lo) & ((p < hi) if b < 4 else (p <= hi))
        assert bins["count"][b] == m.sum()
        ece += m.sum() / 500 * abs(p[m].mean() - y[m].mean())
    assert abs(expected_calibration_error(p, y, num_bins=5) - ece) < 1e-12
    assert expected_calibration_error([1.0, 1.0], [1, 1]) == 0.0
