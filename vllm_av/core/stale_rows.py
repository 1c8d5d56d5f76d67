"""How far a one-step-old survival row predicts a request's next drafts.

The drafting depth and the budget are planned from each request's survival
row of its previous drafting step (`AdaptiveVerifier.stale_scores`), or
from the estimator's prior row for all requests after a step that drafted
nothing: the drafts they plan for do not exist yet. Such a row is not a
calibrated prediction of the next drafts. The next drafts regress toward
the population: in a replay of the real Qwen2.5-Coder pair's HumanEval traces at 4
requests a stale row's top quartile at position 7 (0.95 predicted) saw
0.83 survive at the next step, its bottom quartile (0.23) 0.33
(benchmarks/stale_row_predictiveness.py). The prior row stands for a request with
no row of its own and is mapped the same way.

`StaleRowCalibration` maps each conditional acceptance c of such a row to
what the next drafts showed, per position j,

    c' = sigmoid(a_j + b * logit c),

a logistic regression (K intercepts, one slope) fitted online by Newton
steps over a window of recent labels: a draft's outcome (accepted, or the
first rejection) paired with the row its request had before it was
drafted. Until MIN_LABELS labels have come in the map is the identity
(a_j = 0, b = 1). Nothing here reads a drafted token: the map comes from
past outcomes, so a depth or budget planned from it stays lossless.
"""

from __future__ import annotations

import numpy as np

# Labels before the first fit (the identity until then), and the window the
# fit reads.
MIN_LABELS = 256
WINDOW = 4096
# Steps with labels between two refits.
REFIT_INTERVAL = 8
# A light ridge toward the identity, for positions with few labels.
RIDGE = 1.0
X_LIMIT = 6.0
_EPS = 1e-4


def conditionals(surv: np.ndarray) -> np.ndarray:
    """Survival rows [..., K] -> conditional acceptances [..., K], clipped
    away from 0 and 1 so that their logits are finite."""
    surv = np.asarray(surv, dtype=np.float64)
    prev = np.concatenate([np.ones_like(surv[..., :1]), surv[..., :-1]], axis=-1)
    return np.clip(surv / np.maximum(prev, _EPS), _EPS, 1.0 - _EPS)


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


class StaleRowCalibration:
    """The online map of stale and prior rows (module doc)."""

    def __init__(self, K: int) -> None:
        self.K = K
        self.intercepts = np.zeros(K)
        self.slope = 1.0
        self.fitted = False
        self.version = 0  # changes with each fit: what was derived from the map is stale
        self._x = np.zeros(WINDOW)  # logit c of the row
        self._pos = np.zeros(WINDOW, dtype=np.int64)
        self._y = np.zeros(WINDOW)  # accepted (1) or the first rejection (0)
        self._n = 0  # labels seen (the window holds the last WINDOW)
        self._since_fit = 0

    @property
    def num_labels(self) -> int:
        return self._n

    def apply(self, rows: np.ndarray) -> np.ndarray:
        """Survival rows [..., K] mapped (the rows themselves while the map
        is the identity)."""
        if not self.fitted:
            return rows
        z = self.intercepts + self.slope * np.clip(_logit(conditionals(rows)), -X_LIMIT, X_LIMIT)
        out = np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=-1)
        return out.astype(np.asarray(rows).dtype, copy=False)

    def add(self, rows: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """Outcomes of drafts that followed rows: `rows` [n, K] the survival
        rows each request had before drafting, `verified` and `accepted`
        [n] per request. A position is labelled when it was verified and
        no earlier draft was rejected."""
        if len(rows) == 0:
            return
        pos = np.arange(self.K)
        labelled = pos < np.minimum(accepted + 1, verified)[:, None]  # [n, K]
        if not labelled.any():
            return
        # Logits clipped at +-6 (0.25% .. 99.75%): a row's certainty past
        # that carries no more about the next drafts.
        x = np.clip(_logit(conditionals(rows)), -X_LIMIT, X_LIMIT)[labelled]
        p = np.broadcast_to(pos, labelled.shape)[labelled]
        y = (pos < accepted[:, None])[labelled].astype(np.float64)
        # Into the ring buffer: of more than a window at once, the last window.
        at = (self._n + len(x) - np.arange(min(len(x), WINDOW), 0, -1)) % WINDOW
        self._x[at], self._pos[at], self._y[at] = x[-WINDOW:], p[-WINDOW:], y[-WINDOW:]
        self._n += len(x)
        self._since_fit += 1
        if self._n >= MIN_LABELS and (not self.fitted or self._since_fit >= REFIT_INTERVAL):
            self.refit()

    def refit(self, steps: int = 4) -> None:
        """Newton steps from the current map over the window, with a ridge
        of RIDGE toward the identity."""
        n = min(self._n, WINDOW)
        x, pos, y = self._x[:n], self._pos[:n], self._y[:n]
        K = self.K
        theta = np.concatenate([self.intercepts, [self.slope]])  # [K + 1]
        prior = np.concatenate([np.zeros(K), [1.0]])
        design = np.zeros((n, K + 1))
        design[np.arange(n), pos] = 1.0
        design[:, K] = x

        def objective(t):  # penalised log-likelihood
            z = design @ t
            return float((y * z - np.logaddexp(0.0, z)).sum()
                         - 0.5 * RIDGE * ((t - prior) ** 2).sum())

        best = objective(theta)
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-np.clip(design @ theta, -30.0, 30.0)))
            grad = design.T @ (y - p) - RIDGE * (theta - prior)
            hess = (design * (p * (1.0 - p))[:, None]).T @ design + RIDGE * np.eye(K + 1)
            step = np.linalg.solve(hess, grad)
            # Halve the step until the objective does not fall (rows near
            # 0 or 1 make full Newton steps overshoot).
            for _ in range(20):
                value = objective(theta + step)
                if value >= best:
                    theta, best = theta + step, value
                    break
                step = step / 2
            else:
                break
        self.intercepts, self.slope = theta[:K], float(theta[K])
        self.fitted, self._since_fit = True, 0
        self.version += 1


__all__ = ["MIN_LABELS", "StaleRowCalibration", "conditionals"]
