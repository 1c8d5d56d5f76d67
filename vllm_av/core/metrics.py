"""Calibration and ranking metrics for acceptance predictors (numpy).

Used to compare the online estimator with the unfitted q_max reference on
labelled traces, per position: AUC (does the score rank accepted drafts
above rejected ones), log-loss (are the probabilities right), and expected
calibration error with its reliability bins.
"""

from __future__ import annotations

import numpy as np

# Probabilities are clipped to [LOG_LOSS_EPS, 1 - LOG_LOSS_EPS] so one
# confident mistake costs ~34.5 nats instead of inf.
LOG_LOSS_EPS = 1e-15


def _as_1d(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).ravel()


def roc_auc(scores, labels) -> float:
    """Area under the ROC curve = P(score of a positive > score of a negative),
    ties counted as 1/2 (Mann-Whitney U with mid-ranks). NaN if one class is
    absent."""
    s, y = _as_1d(scores), _as_1d(labels) > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _midranks(s)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given the mean of the ranks they span."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    # Group boundaries of equal values.
    new = np.concatenate(([True], xs[1:] != xs[:-1]))
    group = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    ends = np.concatenate((starts[1:], [xs.size]))
    mid = (starts + ends + 1) / 2.0  # mean of 1-based ranks start+1..end
    ranks = np.empty_like(x)
    ranks[order] = mid[group]
    return ranks


def log_loss(probs, labels, eps: float = LOG_LOSS_EPS) -> float:
    """Mean negative log-likelihood of binary labels, probs clipped to [eps, 1-eps]."""
    p = np.clip(_as_1d(probs), eps, 1.0 - eps)
    y = _as_1d(labels)
    if p.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def reliability_bins(probs, labels, num_bins: int = 10) -> dict[str, np.ndarray]:
    """Equal-width bins over [0, 1]: per bin, count, mean predicted, observed rate.

    Empty bins have count 0 and NaN means. p == 1.0 goes in the last bin.
    """
    p, y = _as_1d(probs), _as_1d(labels)
    idx = np.clip((p * num_bins).astype(np.int64), 0, num_bins - 1)
    count = np.bincount(idx, minlength=num_bins).astype(np.float64)
    sum_p = np.bincount(idx, weights=p, minlength=num_bins)
    sum_y = np.bincount(idx, weights=y, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = sum_p / count
        rate = sum_y / count
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    return {"edges": edges, "count": count, "mean_predicted": mean_p, "observed": rate}


def expected_calibration_error(probs, labels, num_bins: int = 10) -> float:
    """sum_b (n_b / n) |mean predicted_b - observed rate_b| over equal-width bins."""
    bins = reliability_bins(probs, labels, num_bins)
    n = bins["count"].sum()
    if n == 0:
        return float("nan")
    used = bins["count"] > 0
    gap = np.abs(bins["mean_predicted"][used] - bins["observed"][used])
    return float(np.sum(bins["count"][used] / n * gap))


__all__ = ["expected_calibration_error", "log_loss", "reliability_bins", "roc_auc"]
