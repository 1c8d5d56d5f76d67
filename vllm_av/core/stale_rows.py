"""How far a request's one-step-old survival row predicts its next drafts.

The drafting depth and the budget are planned from each request's survival
row of its previous drafting step (`AdaptiveVerifier.stale_scores`): the
drafts they plan for do not exist yet. That row is calibrated for the
drafts it was computed from, not for the next ones, and the next ones
regress toward the population: on the real Qwen2.5-Coder pair's traces a
stale row's top quartile at position 7 (0.95 predicted) saw 0.78 survive
at the next step, its bottom quartile (0.28) 0.39. Planned from raw rows,
the depth overshoots after easy drafts and stops after hard ones.

`StaleRowWeight` fits, online, one weight w per engine: each conditional
acceptance of a stale row is moved toward the estimator's prior in logit
space,

    logit c' = logit c_prior + w * (logit c_stale - logit c_prior),

w = 1 keeping the row and w = 0 using the prior for every request. The
labels are the outcomes of the drafts that followed each stale row (the
accepted ones and the first rejection), so w is a one-parameter logistic
regression with an offset, refitted by Newton steps over a window of
recent labels. Until MIN_LABELS labels have come in, w stays 1 (the rows
as they are). Nothing here reads a drafted token: w comes from past
outcomes, so a depth or budget planned from it stays lossless.
"""

from __future__ import annotations

import numpy as np

# Labels before the first fit (w = 1 until then), and the window the fit
# reads: a few hundred labels pin a single weight to about +-0.1.
MIN_LABELS = 256
WINDOW = 4096
# Steps with labels between two refits.
REFIT_INTERVAL = 8
# The fitted weight's range: 0 (the prior for all) to a little above 1.
WEIGHT_RANGE = (0.0, 1.5)
_EPS = 1e-4


def conditionals(surv: np.ndarray) -> np.ndarray:
    """Survival rows [..., K] -> conditional acceptances [..., K], clipped
    away from 0 and 1 so that their logits are finite."""
    surv = np.asarray(surv, dtype=np.float64)
    prev = np.concatenate([np.ones_like(surv[..., :1]), surv[..., :-1]], axis=-1)
    return np.clip(surv / np.maximum(prev, _EPS), _EPS, 1.0 - _EPS)


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


class StaleRowWeight:
    """The online weight w of stale rows against the prior (module doc)."""

    def __init__(self, K: int) -> None:
        self.K = K
        self.weight = 1.0
        self.fitted = False
        self._z = np.zeros(WINDOW)  # logit c_stale - logit c_prior
        self._offset = np.zeros(WINDOW)  # logit c_prior
        self._y = np.zeros(WINDOW)  # accepted (1) or the first rejection (0)
        self._n = 0  # labels seen (the window holds the last WINDOW)
        self._since_fit = 0

    @property
    def num_labels(self) -> int:
        return self._n

    def apply(self, rows: np.ndarray, prior: np.ndarray) -> np.ndarray:
        """Survival rows [R, K] moved toward `prior` [K] by the weight; the
        rows unchanged while w is 1."""
        if self.weight == 1.0:
            return rows
        cp = _logit(conditionals(prior))
        z = cp + self.weight * (_logit(conditionals(rows)) - cp)
        return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=-1).astype(rows.dtype, copy=False)

    def add(self, stale: np.ndarray, prior: np.ndarray, verified: np.ndarray,
            accepted: np.ndarray) -> None:
        """Outcomes of drafts that followed stale rows: `stale` [n, K] the
        rows each request had before drafting, `prior` [K], `verified` and
        `accepted` [n] per request. A position is labelled when it was
        verified and no earlier draft was rejected."""
        if len(stale) == 0:
            return
        pos = np.arange(self.K)
        labelled = pos < np.minimum(accepted + 1, verified)[:, None]  # [n, K]
        if not labelled.any():
            return
        cp = _logit(conditionals(prior))  # [K]
        z = (_logit(conditionals(stale)) - cp)[labelled]
        offset = np.broadcast_to(cp, labelled.shape)[labelled]
        y = (pos < accepted[:, None])[labelled].astype(np.float64)
        for lo in range(0, len(z), WINDOW):  # ring buffer
            self._put(z[lo:lo + WINDOW], offset[lo:lo + WINDOW], y[lo:lo + WINDOW])
        self._since_fit += 1
        if self._n >= MIN_LABELS and (not self.fitted or self._since_fit >= REFIT_INTERVAL):
            self.refit()

    def _put(self, z, offset, y) -> None:
        at = (self._n + np.arange(len(z))) % WINDOW
        self._z[at], self._offset[at], self._y[at] = z, offset, y
        self._n += len(z)

    def refit(self, steps: int = 4) -> float:
        """Newton steps on w from its current value over the window."""
        n = min(self._n, WINDOW)
        z, off, y = self._z[:n], self._offset[:n], self._y[:n]
        w = self.weight
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-(off + w * z)))
            grad = float(((y - p) * z).sum())
            hess = float((p * (1.0 - p) * z * z).sum())
            if hess <= 1e-9:
                break
            w = float(np.clip(w + grad / hess, *WEIGHT_RANGE))
        self.weight, self.fitted, self._since_fit = w, True, 0
        return w


__all__ = ["MIN_LABELS", "StaleRowWeight", "conditionals"]
