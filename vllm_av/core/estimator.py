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

Fit: iteratively reweighted least squares, one Newton step per window. Each
`observe` adds the window's gradient g and negative Hessian H of the
log-likelihood, evaluated at the current coefficients (constant within a
window), to (K+1)-sized window statistics: memory O(K^2), not
O(steps x batch x K). Every `refit_interval` steps one step is taken and the
window statistics are cleared. Two step rules (`memory`):

  memory > 0 (default): the window's H is kept as a running precision A
  (an online Laplace approximation of the posterior), forgotten
  exponentially with a memory of `memory` labelled drafts:

      A     <- exp(-n_window / memory) * A + H
      delta  = (A + ridge * I)^-1 g

  `ridge` is the prior precision. Early on A is small and steps are full
  Newton steps (fast cold start); as labels accumulate the step shrinks like
  1 / n, so the fit settles instead of jittering; the forgetting keeps
  ~`memory` labels of weight, so a workload change is still followed.

  memory = 0 (the reference design, DESIGN 2.1 as first written): each
  window alone, shrunk per parameter by the labels behind it,

      delta = (H + ridge * I)^-1 g,  delta_j *= n_j / (n_j + damping).

  At batch 1 a window holds 25-40 labels, so this is a noisy re-estimate
  scaled by ~0.25, a constant learning rate that never settles.

Damping applies in both modes as delta_j *= n_j / (n_j + damping): with
memory = 0, n_j counts the window's labels behind parameter j (all labels for
the slope, position j's for b_j); with memory > 0, the forgotten labels
behind the running precision, so it only slows the first refits of a thinly
observed position (off by default there: the precision already does that).
Then each |delta_j| is capped at max_step (a trust region) and the
coefficients are clamped to +-COEF_CLIP.

Evidence (docs/estimator_report.md, real traces, batch-1 prequential replay):
memory 3000 against memory 0 gives online log-loss 0.2043 -> 0.1981
(HumanEval) and 0.4112 -> 0.4052 (MT-Bench), ECE 0.026 -> 0.010 and
0.027 -> 0.012, and reaches a running ECE under 0.02 after 1140 instead of
1970 labelled drafts (HumanEval) and 1520 instead of 1860 (MT-Bench).

New-request prior (`prior_survival`): the cumulative product of the observed
per-position acceptance rates (forgotten like the precision), falling back
to the model at the mean observed feature where a position has no labels.

Host sync: none. `observe`, `predict`, `prior_survival` and the refit are
tensor ops on the features' device; the refit uses `torch.linalg.solve_ex`
(no error check, so no sync) and `torch.where` to keep the old coefficients
when the solve is not finite. Only the `slope` / `intercepts` properties
(for logging and metrics) copy to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_av.core.features import FEATURE_CLIP
from vllm_av.core.fused import fused_observe

# Defaults, chosen on the labelled traces in shared/data/traces (Qwen2.5-Coder
# 0.5B -> 1.5B, HumanEval and MT-Bench, K=7), replayed online at batch 1, 8
# and 32, each step scored before it is observed (docs/estimator_report.md).
#
# Memory of the running precision, in labelled drafts. Against memory 0 (the
# plain damped step): batch-1 log-loss 0.2043 -> 0.1981 HumanEval, 0.4112 ->
# 0.4052 MT-Bench (prompt-bootstrap 95% intervals of the gain exclude 0 on
# both), ECE 0.026 -> 0.010 and 0.027 -> 0.012; 0.001-0.003 nats at batch
# 8/32, where windows are less noisy. 3000 was best or tied at batch 1, 8, 32
# and in the drift replays (HumanEval then MT-Bench and the reverse); an
# infinite memory tied on a stationary stream but followed the switch worse
# (ECE 0.024 vs 0.018).
DEFAULT_MEMORY = 3000.0
# Refit every 8 steps: at batch 1 a window holds ~25-40 labels; at batch 64
# it is a refit every ~0.1 s of decoding, so drift is followed quickly.
# (Grid for memory 0: refit {4,8,16,32} x damping {10,30,100} x ridge {1,10}
# x max_step {0.5,1,inf}; 8 was within 0.003 nats of the best everywhere.)
DEFAULT_REFIT_INTERVAL = 8
# Damping c for memory = 0: the step on a parameter is scaled by n / (n + 100),
# small for thin windows (batch 1, deep positions), ~1 (plain Newton) once a
# window holds thousands of labels. Low damping with memory 0 at batch 1 blew
# up to 0.45-3.8 nats. With memory > 0 the default is no damping: the running
# precision already shrinks the step like 1 / n, and damping 100 on top (on
# the forgotten counts) cost 0.002 nats and doubled the ECE on both datasets.
DEFAULT_DAMPING = 100.0
# Ridge 1.0 on the Hessian: a unit-precision Gaussian prior on the
# coefficients (memory > 0) or on the step (memory 0). 10 pulled the
# intercepts too hard toward the prior (+0.003 nats), 100 more (+0.013).
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
    """p_i = sigmoid(w * f_i + b_i), fitted online by IRLS (see module doc).

    Args:
        num_positions: K, the number of draft positions (intercepts).
        refit_interval: `observe` calls (engine steps) per Newton step.
        damping: c in the per-parameter step factor n / (n + c); None gives
            DEFAULT_DAMPING with memory 0 and no damping otherwise.
        ridge: added to the Hessian's (or running precision's) diagonal.
        max_step: cap on each coefficient's change per refit.
        memory: labelled drafts of weight kept in the running precision and
            the acceptance rates of prior_survival; 0 steps from each window
            alone (the rates then keep DEFAULT_MEMORY); math.inf never forgets.
        device: where the coefficients and statistics live; they follow the
            features' device on first use if it differs (a one-time copy).
        slope: prior slope. intercept: prior intercept, a float or K floats
            (for example fitted offline on an earlier run of the same pair).
        prior_mean_feature: feature assumed for new requests until observed.
    """

    def __init__(
        self,
        num_positions: int,
        refit_interval: int = DEFAULT_REFIT_INTERVAL,
        damping: float | None = None,
        ridge: float = DEFAULT_RIDGE,
        max_step: float = DEFAULT_MAX_STEP,
        memory: float = DEFAULT_MEMORY,
        device: torch.device | str | None = None,
        slope: float = PRIOR_SLOPE,
        intercept: float | Sequence[float] = PRIOR_INTERCEPT,
        prior_mean_feature: float = PRIOR_MEAN_FEATURE,
    ) -> None:
        if num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {num_positions}")
        if refit_interval < 1:
            raise ValueError(f"refit_interval must be >= 1, got {refit_interval}")
        if damping is None:
            damping = DEFAULT_DAMPING if memory == 0 else 0.0
        if damping < 0 or ridge < 0 or not memory >= 0:
            raise ValueError(
                f"damping, ridge and memory must be >= 0, got {damping}, {ridge}, {memory}"
            )
        self.num_positions = num_positions
        self.refit_interval = refit_interval
        self.damping = float(damping)
        self.ridge = float(ridge)
        self.max_step = float(max_step)
        self.memory = float(memory)
        # Horizon of the acceptance rates behind prior_survival: the plain
        # step keeps no history, but a prior from one window would be noise.
        self._rate_memory = self.memory if self.memory > 0 else DEFAULT_MEMORY
        self.num_steps = 0  # observe calls since construction (host int)
        self.num_refits = 0
        device = torch.device(device) if device is not None else torch.device("cpu")
        K, P = num_positions, num_positions + 1
        # theta = [w, b_0 .. b_{K-1}]; float32 is what predict multiplies with.
        b = torch.as_tensor(intercept, dtype=torch.float32).flatten()
        if b.numel() not in (1, K):
            raise ValueError(f"intercept needs 1 or {K} values, got {b.numel()}")
        self._theta = torch.cat([torch.tensor([float(slope)]), b.expand(K)]).to(device)
        self._theta0 = self._theta.clone()  # the prior, for forget()
        self._prior_mean_feature = float(prior_mean_feature)
        # Host copy of theta for slope / intercepts, read once per refit: the
        # metrics snapshot reads them every few steps, and on a GPU each read
        # would wait for the device (a stall of the async pipeline).
        self._theta_host: list[float] | None = None
        # Window statistics per position, cleared at every refit: the sums
        # the gradient, Hessian, label counts and feature means are made of
        # (_WINDOW_COLUMNS), one tensor so that a step adds them in one
        # operation. float64: a window sums thousands of p(1-p) f^2 terms.
        self._window = torch.zeros(K, len(_WINDOW_COLUMNS), dtype=torch.float64, device=device)
        self._positions = torch.arange(K, device=device)  # [K]
        # Running (forgotten) state, folded in at every refit.
        self._precision = torch.zeros(P, P, dtype=torch.float64, device=device)  # [P, P]
        self._label_n = torch.zeros(K, dtype=torch.float64, device=device)  # [K]
        self._label_acc = torch.zeros(K, dtype=torch.float64, device=device)  # [K]
        self._mean_feature = torch.full((K,), float(prior_mean_feature), device=device)
        # prior_survival per width, until the statistics change (a step that
        # drafts nothing reads it and changes nothing).
        self._prior_memo: dict[int, torch.Tensor] = {}
        self._prior_host_memo: dict[int, np.ndarray] = {}

    _STATE = ("_theta", "_theta0", "_window", "_positions",
              "_precision", "_label_n", "_label_acc", "_mean_feature")

    # ------------------------------------------------------------------ state
    @property
    def device(self) -> torch.device:
        return self._theta.device

    def to(self, device) -> "OnlineAcceptanceEstimator":
        """Move coefficients and statistics to `device` (a one-time copy)."""
        for name in self._STATE:
            setattr(self, name, getattr(self, name).to(device))
        self._prior_memo.clear()
        self._prior_host_memo.clear()
        return self

    def forget(self) -> None:
        """Drop everything observed so far: the prior coefficients again and
        empty statistics. For outcomes that were not served drafts (an
        engine's warm-up steps verify dummy drafts, nearly all accepted).
        Counts as a refit, so that whoever copies the coefficients at
        refits copies them again."""
        self._theta.copy_(self._theta0)
        self._theta_host = None
        for t in (self._window, self._precision, self._label_n, self._label_acc):
            t.zero_()
        self._mean_feature.fill_(self._prior_mean_feature)
        self._prior_memo.clear()
        self._prior_host_memo.clear()
        self.num_steps = 0
        self.num_refits += 1

    def _host_theta(self) -> list[float]:
        if self._theta_host is None:
            self._theta_host = self._theta.tolist()
        return self._theta_host

    @property
    def slope(self) -> float:
        """Shared slope w as a Python float (a host sync after each refit;
        for logging and metrics)."""
        return float(self._host_theta()[0])

    @property
    def intercepts(self) -> list[float]:
        """Intercepts b_0..b_{K-1} as Python floats (a host sync after each
        refit; for logging and metrics)."""
        return list(self._host_theta()[1:])

    @property
    def coefficients(self) -> torch.Tensor:
        """[w, b_0, ..., b_{K-1}] on the estimator's device (no sync; a copy)."""
        return self._theta.clone()

    @property
    def mean_features(self) -> torch.Tensor:
        """[K] per-position mean feature of verified slots as of the last
        refit (the prior's fallback point; no sync; a copy)."""
        return self._mean_feature.clone()

    # ------------------------------------------------------------- inference
    def _take(self, features: torch.Tensor) -> None:
        """Check the features' width; follow their device (a one-time copy)."""
        k = features.shape[-1]
        if k > self.num_positions:
            raise ValueError(
                f"features have {k} positions, estimator was built for "
                f"{self.num_positions} (num_speculative_tokens)"
            )
        if features.device != self.device:
            self.to(features.device)

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        self._take(features)
        return self._logits_of(_clean(features))

    def _logits_of(self, f: torch.Tensor) -> torch.Tensor:
        """Logits of clean features (`_clean`)."""
        return self._theta[0] * f + self._theta[1 : f.shape[-1] + 1]  # [R, k]

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """Conditional acceptance probabilities: [R, k] features -> [R, k], k <= K."""
        return torch.sigmoid(self._logits(features))

    def prior_survival(self, num_positions: int | None = None) -> torch.Tensor:
        """Survival scores [k] for a request with no history (DESIGN 2.2).

        Cumprod of the observed per-position acceptance rates (running,
        forgotten, plus the current window); the model at the mean feature
        where a position has no labels yet. Not the model at the mean feature
        everywhere: logit(q_max) is heavy-tailed, so by Jensen that over-states
        acceptance (Brier 0.46 vs 0.28 on HumanEval, 0.27 vs 0.21 on MT-Bench;
        upstream's 1.0: 0.55 / 0.62; docs/estimator_report.md section 4).
        On the estimator's device, no sync.
        """
        k = self.num_positions if num_positions is None else num_positions
        memo = self._prior_memo.get(k)
        if memo is None:
            model = self.predict(self._mean_feature[:k].unsqueeze(0))[0].double()  # [k]
            n = self._label_n[:k] + self._window[:k, _LABELLED]
            acc = self._label_acc[:k] + self._window[:k, _ACCEPTED]
            rate = torch.where(n > 0, acc / n.clamp(min=1e-300), model).clamp(0.0, 1.0)
            memo = self._prior_memo[k] = torch.cumprod(rate, dim=-1).float()
        return memo.clone()

    def prior_survival_host(self, num_positions: int | None = None) -> np.ndarray:
        """`prior_survival` as a read-only host array, copied once per change
        of the statistics (the depth choice reads it every step; steps that
        draft nothing would otherwise pay a device-to-host copy each)."""
        k = self.num_positions if num_positions is None else num_positions
        host = self._prior_host_memo.get(k)
        if host is None:
            host = self._prior_host_memo[k] = self.prior_survival(k).cpu().numpy()
            host.flags.writeable = False
        return host

    # ---------------------------------------------------------------- fitting
    def observe(
        self,
        features: torch.Tensor,
        num_admitted: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> None:
        """Add one step's verified drafts to the window; refit on schedule.

        features: [R, k] the features that were used for this step's drafts.
        num_admitted: [R] drafts verified per request (the rest were trimmed).
        num_accepted: [R] accepted drafts per request (<= num_admitted).
        """
        self._take(features)
        self._accumulate(features, num_admitted, num_accepted)
        self._observed()

    def observe_rows(
        self,
        table: torch.Tensor,
        rows: torch.Tensor,
        num_admitted: torch.Tensor,
        num_accepted: torch.Tensor,
        totals: torch.Tensor | None = None,
    ) -> None:
        """`observe` of the features table[rows] (all K positions); rows
        < 0 are padding and observe nothing. With `totals` ([2] float64),
        adds the valid rows' accepted and admitted counts to it. On a GPU
        one kernel (`fused.fused_observe`) instead of the operations of
        `observe`, which stay its reference."""
        self._take(table)
        if not fused_observe(table, rows, num_admitted, num_accepted,
                             self._theta, self._window, totals):
            valid = rows >= 0
            feats = table.index_select(0, rows.clamp(min=0).long())[:, : self.num_positions]
            zero = torch.zeros_like(num_admitted)
            adm = torch.where(valid, num_admitted, zero)
            acc = torch.where(valid, num_accepted, zero)
            self._accumulate(feats, adm, acc)
            if totals is not None:
                totals += torch.stack([acc.sum(), adm.sum()]).to(totals.dtype)
        self._observed()

    def observe_sampled_rows(
        self,
        table: torch.Tensor,
        rows: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        totals: torch.Tensor | None = None,
    ) -> None:
        """`observe_rows` with the counts as rejection sampling reports
        them: tokens sampled per request (accepted drafts + 1; 0 when nothing
        was verified, as for a prompt chunk) and drafts rejected. On a GPU
        the conversion runs inside the one kernel."""
        self._take(table)
        if fused_observe(table, rows, num_sampled, num_rejected, self._theta,
                         self._window, totals, from_sampled=True):
            self._observed()
            return
        accepted = (num_sampled - 1).clamp(min=0)
        self.observe_rows(table, rows, accepted + num_rejected.clamp(min=0), accepted,
                          totals=totals)

    def _observed(self) -> None:
        """Bookkeeping after a step's statistics were added: the prior's
        memos are stale, and the refit comes on schedule."""
        self._prior_memo.clear()
        self._prior_host_memo.clear()
        self.num_steps += 1
        if self.num_steps % self.refit_interval == 0:
            self.refit()

    def _accumulate(self, features, num_admitted, num_accepted) -> None:
        """Add one step's window statistics (the operations `fused_observe`
        fuses)."""
        k = features.shape[-1]
        f = _clean(features)  # [R, k] float32
        p = torch.sigmoid(self._logits_of(f).double())  # [R, k]
        f64 = f.double()
        dev = f.device
        n_adm = num_admitted.to(dev).long().clamp(0, k)  # [R]
        n_acc = torch.minimum(num_accepted.to(dev).long().clamp(min=0), n_adm)
        # Labelled: accepted slots, plus the first rejection if it was
        # verified; accepted; verified (each a slot below its count).
        bounds = torch.stack([torch.minimum(n_acc + 1, n_adm), n_acc, n_adm])  # [3, R]
        m, y, verified = (self._positions[:k] < bounds.unsqueeze(-1)).double()  # [R, k] each
        resid = m * (y - p)  # [R, k]  d loglik / d logit
        wt = m * p * (1.0 - p)  # [R, k]  -d2 loglik / d logit2
        wt_f = wt * f64
        # Per position (_WINDOW_COLUMNS): summed over the requests at once.
        self._window[:k] += torch.stack(
            [resid, resid * f64, wt, wt_f, wt_f * f64, m, y, verified, verified * f64], -1
        ).sum(0)

    def refit(self) -> None:
        """One Newton step from the window (and running precision), then
        clear the window statistics."""
        self._prior_memo.clear()
        self._prior_host_memo.clear()
        P = self.num_positions + 1
        eye = torch.eye(P, dtype=torch.float64, device=self.device)
        grad, hess, count = self._window_fit_terms()
        w = self._window
        # count[0] = labelled drafts in this window (a tensor: no host sync).
        forget = torch.exp(-count[0] / self._rate_memory)
        self._label_n = forget * self._label_n + count[1:]
        self._label_acc = forget * self._label_acc + w[:, _ACCEPTED]
        if self.memory > 0:
            self._precision = forget * self._precision + hess
            curvature = self._precision
            behind = torch.cat([self._label_n.sum().reshape(1), self._label_n])  # [P]
        else:
            curvature, behind = hess, count
        delta, _info = torch.linalg.solve_ex(curvature + self.ridge * eye, grad)
        if self.damping > 0:
            delta = delta * (behind / (behind + self.damping))
        # Trust region: a small or separable window (every slot accepted) has a
        # near-flat likelihood and asks for a huge step; cap it per refit.
        delta = delta.clamp(-self.max_step, self.max_step)
        new = (self._theta.double() + delta).clamp(-COEF_CLIP, COEF_CLIP)
        # A singular or overflowing window must not poison the coefficients
        # (or the precision): keep the old ones unless every entry is finite.
        ok = torch.isfinite(new).all()
        self._theta = torch.where(ok, new, self._theta.double()).float()
        self._theta_host = None
        if self.memory > 0:
            self._precision = torch.where(
                torch.isfinite(self._precision).all(), self._precision, torch.zeros_like(eye)
            )

        feat_n = w[:, _VERIFIED]
        mean = w[:, _FEATURE_SUM] / feat_n.clamp(min=1.0)
        self._mean_feature = torch.where(feat_n > 0, mean.float(), self._mean_feature)

        self._window.zero_()
        self.num_refits += 1

    def _window_fit_terms(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window's log-likelihood gradient [P] and negative Hessian
        [P, P] in theta = [w, b_0..b_{K-1}] (features f for w, one-hot
        positions for the intercepts, so their block is diagonal), and its
        label counts [P] (total, then per position)."""
        w = self._window
        P = self.num_positions + 1
        grad = torch.cat([w[:, _RESID_F].sum().reshape(1), w[:, _RESID]])
        hess = torch.zeros(P, P, dtype=torch.float64, device=w.device)
        hess[0, 0] = w[:, _WT_FF].sum()
        hess[0, 1:] = w[:, _WT_F]
        hess[1:, 0] = w[:, _WT_F]
        hess[1:, 1:] = torch.diag(w[:, _WT])
        count = torch.cat([w[:, _LABELLED].sum().reshape(1), w[:, _LABELLED]])
        return grad, hess, count

    def statistics(self) -> dict[str, torch.Tensor]:
        """Window statistics and running precision (copies), for tests and metrics."""
        grad, hess, count = self._window_fit_terms()
        return {
            "hessian": hess,
            "gradient": grad,
            "count": count,
            "accepted": self._window[:, _ACCEPTED].clone(),
            "precision": self._precision.clone(),
        }


def _clean(features: torch.Tensor) -> torch.Tensor:
    """Features as the model reads them: float32, NaN as 0, clipped."""
    return torch.nan_to_num(features.float(), nan=0.0).clamp(-FEATURE_CLIP, FEATURE_CLIP)


# Columns of the window statistics, per position, summed over the window's
# slots: the residual r = y - p and weight wt = p (1 - p) of labelled slots
# (times their feature f, f^2), the labelled and accepted slots, the verified
# slots and their features (for the mean feature).
_WINDOW_COLUMNS = ("resid", "resid_f", "wt", "wt_f", "wt_ff", "labelled", "accepted",
                   "verified", "feature_sum")
(_RESID, _RESID_F, _WT, _WT_F, _WT_FF, _LABELLED, _ACCEPTED, _VERIFIED,
 _FEATURE_SUM) = range(len(_WINDOW_COLUMNS))


__all__ = [
    "COEF_CLIP",
    "DEFAULT_DAMPING",
    "DEFAULT_MAX_STEP",
    "DEFAULT_MEMORY",
    "DEFAULT_REFIT_INTERVAL",
    "DEFAULT_RIDGE",
    "OnlineAcceptanceEstimator",
]
