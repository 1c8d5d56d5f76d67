"""Online acceptance estimator for drafters without a trained confidence head.

Model (DESIGN 2.1): the probability that draft slot i is accepted, given that
every earlier slot of its step was accepted, is

    p_i = sigmoid(w * f_i + b_i),

with f_i a lossless feature of the draft distribution q_i (by default
logit(q_max), see features.py), one slope w shared by all positions and one
intercept b_i per position: K + 1 parameters, theta = [w, b_0, ..., b_{K-1}].

Labels: slots below num_accepted are labelled 1; the first rejection (slot
num_accepted, if it was verified) is labelled 0; slots after the first
rejection and trimmed (never verified) slots carry no label. Each labelled
slot is a Bernoulli draw from p_i *conditional on reaching it*, so this
censoring keeps the likelihood exact.

Fit: iteratively reweighted least squares, one damped Newton step per window.
Each `observe` adds the window's gradient g and negative Hessian H of the
log-likelihood, evaluated at the current coefficients (which are constant
within a window), to (K+1)-sized accumulators: memory O(K^2), not
O(steps x batch x K). Every `refit_interval` steps

    delta = (H + ridge * I)^-1 g,  delta_j *= n_j / (n_j + damping),

with n_j the labelled count behind parameter j (all labels for the slope,
labels at position j for b_j), so rarely reached deep positions move slowly;
each |delta_j| is then capped at max_step (a trust region) and the
coefficients are clamped to +-COEF_CLIP. Then the accumulators are cleared. Because the Hessian is rebuilt around the
new coefficients, the sequence of windows is a stochastic Newton method; the
ridge doubles as a trust region that keeps one noisy window from throwing
the coefficients far.

Host sync: none. `observe`, `predict` and the refit are tensor ops on the
features' device; the refit uses `torch.linalg.solve_ex` (no error check, so
no sync) and a `torch.where` that keeps the old coefficients when the solve
is not finite. Only the `slope` / `intercepts` properties (for logging and
metrics) copy to the host.
"""

from __future__ import annotations

import torch

from vllm_av.core.features import FEATURE_CLIP

# Defaults, chosen on the labelled traces in shared/data/traces (Qwen2.5-Coder
# 0.5B -> 1.5B, HumanEval and MT-Bench, K=7), replayed online at batch 1 and
# batch 8 (prompts interleaved), each step scored before it is observed.
# Grid: refit_interval {4,8,16,32} x damping {10,30,100} x ridge {1,10} x
# max_step {0.5,1,inf}. The chosen point is within 0.003 nats of the best
# cell in all four settings (online log-loss 0.204/0.201 HumanEval,
# 0.411/0.409 MT-Bench, against 0.220/0.436 for the unfitted q_max), while
# low damping or no step cap at batch 1 blew up to 0.45-3.8 nats.
#
# Refit every 8 steps: at batch 1 a window holds ~25-40 labels; at batch 64
# it is a refit every ~0.1 s of decoding, so drift is followed quickly.
# (32 was marginally better at batch 1 and worse at batch 8.)
DEFAULT_REFIT_INTERVAL = 8
# Damping c = 100: the step on a parameter is scaled by n / (n + 100), a
# learning rate that is small for thin windows (batch 1, deep positions) and
# ~1 (plain Newton) once a window holds thousands of labels (large batches).
DEFAULT_DAMPING = 100.0
# Ridge 1.0 on the Hessian: a unit-precision Gaussian prior on the step; it
# only matters when a window is tiny or singular (a position never reached).
DEFAULT_RIDGE = 1.0
# Cap on |step| per parameter per refit (a trust region). Separable windows
# (every slot accepted) ask for an unbounded step; without the cap a batch-1
# replay reached log-loss 0.45 on HumanEval. 0.5 in logit units per refit
# still lets a coefficient cross its whole useful range in ~10 refits.
DEFAULT_MAX_STEP = 0.5
# Coefficients are clamped to +-COEF_CLIP. With features clipped to
# +-FEATURE_CLIP this bounds every logit to a few hundred, where sigmoid is
# saturated but finite; real fits on the traces stay within +-3.
COEF_CLIP = 20.0
# Prior coefficients: slope 1, intercepts 0 gives p_i = q_max exactly
# (sigmoid(logit(q_max)) = q_max): "the draft's own top probability is its
# acceptance rate", the standard reference for a feature-only drafter, and
# the right answer when draft and target agree. The fit moves from there.
PRIOR_SLOPE = 1.0
PRIOR_INTERCEPT = 0.0
# Mean feature assumed for new requests before anything is observed:
# logit(q_max) = 2 (q_max ~ 0.88), roughly the mean over drafted slots on the
# traces; replaced by the observed per-position mean at the first refit.
PRIOR_MEAN_FEATURE = 2.0


class OnlineAcceptanceEstimator:
    """p_i = sigmoid(w * f_i + b_i), fitted online by damped IRLS.

    Args:
        num_positions: K, the number of draft positions (intercepts).
        refit_interval: `observe` calls (engine steps) per Newton step.
        damping: c in the per-parameter step factor n / (n + c).
        ridge: added to the Hessian's diagonal before solving.
        max_step: cap on each coefficient's change per refit.
        device: where the coefficients and statistics live; they follow the
            features' device on first use if it differs (a one-time copy).
        slope, intercept: prior coefficients (see PRIOR_SLOPE).
        prior_mean_feature: feature assumed for new requests until observed.
    """

    def __init__(
        self,
        num_positions: int,
        refit_interval: int = DEFAULT_REFIT_INTERVAL,
        damping: float = DEFAULT_DAMPING,
        ridge: float = DEFAULT_RIDGE,
        max_step: float = DEFAULT_MAX_STEP,
        device: torch.device | str | None = None,
        slope: float = PRIOR_SLOPE,
        intercept: float = PRIOR_INTERCEPT,
        prior_mean_feature: float = PRIOR_MEAN_FEATURE,
    ) -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        if refit_interval < 1:
            raise ValueError(f"refit_interval must be >= 1, got {refit_interval}")
        if damping < 0 or ridge < 0:
            raise ValueError(f"damping and ridge must be >= 0, got {damping}, {ridge}")
        self.num_positions = num_positions
        self.refit_interval = refit_interval
        self.damping = float(damping)
        self.ridge = float(ridge)
        self.max_step = float(max_step)
        self.num_steps = 0  # observe calls since construction (host int)
        self.num_refits = 0
        device = torch.device(device) if device is not None else torch.device("cpu")
        P = num_positions + 1
        # theta = [w, b_0 .. b_{K-1}]; float32 is what predict multiplies with.
        self._theta = torch.full((P,), float(intercept), device=device)
        self._theta[0] = float(slope)
        # Statistics in float64: a window sums thousands of p(1-p) f^2 terms.
        self._hess = torch.zeros(P, P, dtype=torch.float64, device=device)  # [P, P]
        self._grad = torch.zeros(P, dtype=torch.float64, device=device)  # [P]
        self._count = torch.zeros(P, dtype=torch.float64, device=device)  # [P]
        # Per-position mean feature for the new-request prior.
        self._feat_sum = torch.zeros(num_positions, dtype=torch.float64, device=device)
        self._feat_n = torch.zeros(num_positions, dtype=torch.float64, device=device)
        self._mean_feature = torch.full(
            (num_positions,), float(prior_mean_feature), device=device
        )

    # ------------------------------------------------------------------ state
    @property
    def device(self) -> torch.device:
        return self._theta.device

    def to(self, device) -> "OnlineAcceptanceEstimator":
        """Move coefficients and statistics to `device` (a one-time copy)."""
        for name in ("_theta", "_hess", "_grad", "_count", "_feat_sum", "_feat_n",
                     "_mean_feature"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @property
    def slope(self) -> float:
        """Shared slope w as a Python float (host sync: for logging only)."""
        return float(self._theta[0].item())

    @property
    def intercepts(self) -> list[float]:
        """Intercepts b_0..b_{K-1} as Python floats (host sync: logging only)."""
        return self._theta[1:].tolist()

    @property
    def coefficients(self) -> torch.Tensor:
        """[w, b_0, ..., b_{K-1}] on the estimator's device (no sync; a copy)."""
        return self._theta.clone()

    # ------------------------------------------------------------- inference
    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        k = features.shape[-1]
        if k > self.num_positions:
            raise ValueError(
                f"features have {k} positions, estimator was built for "
                f"{self.num_positions} (num_speculative_tokens)"
            )
        if features.device != self.device:
            self.to(features.device)
        f = torch.nan_to_num(features.float(), nan=0.0).clamp(-FEATURE_CLIP, FEATURE_CLIP)
        return self._theta[0] * f + self._theta[1 : k + 1]  # [R, k]

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """Conditional acceptance probabilities: [R, k] features -> [R, k], k <= K."""
        return torch.sigmoid(self._logits(features))

    def prior_survival(self, num_positions: int | None = None) -> torch.Tensor:
        """Survival scores [k] for a request with no history (DESIGN 2.2).

        p_i = sigmoid(w * mean_f_i + b_i) at the observed per-position mean
        feature, then cumprod. Better than upstream's 1.0, which admits every
        new request's whole draft whatever it is worth. On the estimator's
        device, no sync; copy it to the host alongside the stale scores.
        """
        k = self.num_positions if num_positions is None else num_positions
        probs = self.predict(self._mean_feature[:k].unsqueeze(0))  # [1, k]
        return torch.cumprod(probs, dim=-1)[0]

    # ---------------------------------------------------------------- fitting
    def observe(
        self,
        features: torch.Tensor,
        num_admitted: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> None:
        """Add one step's verified drafts to the statistics; refit on schedule.

        features: [R, k] the features that were used for this step's drafts.
        num_admitted: [R] drafts verified per request (the rest were trimmed).
        num_accepted: [R] accepted drafts per request (<= num_admitted).
        """
        logits = self._logits(features)  # [R, k]; also moves state if needed
        R, k = logits.shape
        dev = logits.device
        f = torch.nan_to_num(features.float(), nan=0.0).clamp(-FEATURE_CLIP, FEATURE_CLIP)
        pos = torch.arange(k, device=dev).unsqueeze(0)  # [1, k]
        n_adm = num_admitted.to(dev).long().clamp(0, k).unsqueeze(1)  # [R, 1]
        n_acc = num_accepted.to(dev).long().clamp(min=0).unsqueeze(1)
        n_acc = torch.minimum(n_acc, n_adm)
        # Labelled: accepted slots, plus the first rejection if it was verified.
        labelled = pos < torch.minimum(n_acc + 1, n_adm)  # [R, k]
        y = (pos < n_acc).double()  # [R, k]
        m = labelled.double()
        p = torch.sigmoid(logits.double())
        f64 = f.double()
        resid = m * (y - p)  # [R, k]  d loglik / d logit
        wt = m * p * (1.0 - p)  # [R, k]  -d2 loglik / d logit2

        P = self.num_positions + 1
        grad = torch.zeros(P, dtype=torch.float64, device=dev)
        grad[0] = (resid * f64).sum()
        grad[1 : k + 1] = resid.sum(0)
        hess = torch.zeros(P, P, dtype=torch.float64, device=dev)
        hess[0, 0] = (wt * f64 * f64).sum()
        cross = (wt * f64).sum(0)  # [k]
        hess[0, 1 : k + 1] = cross
        hess[1 : k + 1, 0] = cross
        hess[1 : k + 1, 1 : k + 1] = torch.diag(wt.sum(0))  # intercepts are one-hot
        count = torch.zeros(P, dtype=torch.float64, device=dev)
        count[1 : k + 1] = m.sum(0)
        count[0] = count[1:].sum()

        self._grad += grad
        self._hess += hess
        self._count += count
        # Mean feature over verified slots, for prior_survival.
        verified = (pos < n_adm).double()
        self._feat_sum[:k] += (verified * f64).sum(0)
        self._feat_n[:k] += verified.sum(0)

        self.num_steps += 1
        if self.num_steps % self.refit_interval == 0:
            self.refit()

    def refit(self) -> None:
        """One damped Newton step from the accumulated window, then clear it."""
        P = self.num_positions + 1
        eye = torch.eye(P, dtype=torch.float64, device=self.device)
        delta, _info = torch.linalg.solve_ex(self._hess + self.ridge * eye, self._grad)
        delta = delta * (self._count / (self._count + self.damping + 1e-12))
        # Trust region: a small or separable window (every slot accepted) has a
        # near-flat likelihood and asks for a huge step; cap it per refit.
        delta = delta.clamp(-self.max_step, self.max_step)
        new = (self._theta.double() + delta).clamp(-COEF_CLIP, COEF_CLIP)
        # A singular or overflowing window must not poison the coefficients:
        # keep the old ones unless every entry of the update is finite.
        ok = torch.isfinite(new).all()
        self._theta = torch.where(ok, new, self._theta.double()).float()

        seen = self._feat_n > 0
        mean = self._feat_sum / self._feat_n.clamp(min=1.0)
        self._mean_feature = torch.where(seen, mean.float(), self._mean_feature)

        for t in (self._hess, self._grad, self._count, self._feat_sum, self._feat_n):
            t.zero_()
        self.num_refits += 1

    def statistics(self) -> dict[str, torch.Tensor]:
        """The current window's accumulators (copies), for tests and metrics."""
        return {
            "hessian": self._hess.clone(),
            "gradient": self._grad.clone(),
            "count": self._count.clone(),
        }


__all__ = [
    "COEF_CLIP",
    "DEFAULT_DAMPING",
    "DEFAULT_MAX_STEP",
    "DEFAULT_REFIT_INTERVAL",
    "DEFAULT_RIDGE",
    "OnlineAcceptanceEstimator",
]
