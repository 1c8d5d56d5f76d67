"""One engine's adaptive-verification state, step by step (DESIGN 2).

`AdaptiveVerifier` ties the pieces together for an engine that drafts,
then verifies: per step it turns draft features into confidences and
survival scores, sizes the budget from the ONE-STEP-OLD scores of the
requests in the batch, admits the top-B current slots, and later feeds the
accept/reject outcome of the admitted drafts back to the estimator.

Losslessness (DESIGN 2.5): the budget B is a function of scores computed
before this step's drafts existed (each request's survival row from its
previous drafting step, or the estimator's prior for a new request) and of
counts known before drafting. The admission of slot i then depends on the
current survival of slots that outrank it, never on slot i's own token:
survival is non-increasing along a row and the tie rule ranks earlier
positions first, so the slots of row r deeper than i (whose features do
depend on x_i) never outrank slot i.

The class is engine-agnostic (numpy + torch); the vLLM adapter and the
simulator drive the same object, so the simulator measures the policy that
ships.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_av.core.budget import size_budget
from vllm_av.core.cost_model import CostModel
from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.selector import select_admitted
from vllm_av.core.survival import survival


@dataclass
class VerifierStats:
    """Running totals for metrics (host-side numbers)."""

    num_steps: int = 0
    drafted: int = 0
    admitted: int = 0
    accepted: int = 0
    trimmed: int = 0
    last_budget: int = 0
    # Per position: sum of predicted conditional acceptance and of observed
    # labels over labelled slots, and the label count (calibration).
    predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))
    observed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    labelled: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass
class _Pending:
    features: torch.Tensor  # [K] features of the drafted slots
    conf: np.ndarray  # [K] predicted conditional acceptance
    admitted: int


class AdaptiveVerifier:
    """Per-engine AV policy: admit drafts each step, learn from outcomes.

    Args:
        num_speculative_tokens: K.
        cost: the step-cost model (verification by tokens, drafting by
            requests).
        estimator: the confidence model; a fresh online estimator by default.
        selector: `select_admitted` or its compiled form (worth it on GPU;
            eager is faster at the CPU backend's sizes).
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        cost: CostModel,
        estimator: OnlineAcceptanceEstimator | None = None,
        selector=None,
    ) -> None:
        self.K = num_speculative_tokens
        self.cost = cost
        self.estimator = estimator or OnlineAcceptanceEstimator(num_speculative_tokens)
        self.selector = selector or select_admitted
        # req_id -> survival row [K] from that request's last drafting step.
        self._stale: dict[str, np.ndarray] = {}
        self._pending: dict[str, _Pending] = {}
        self.stats = VerifierStats(
            predicted=np.zeros(self.K), observed=np.zeros(self.K), labelled=np.zeros(self.K)
        )

    # --------------------------------------------------------------- admit
    def stale_scores(self, req_ids: list[str], num_drafted: np.ndarray) -> np.ndarray:
        """Scores for the budget: each request's previous-step survival row
        (the estimator's prior for a request seen for the first time), cut
        to the number of slots it drafts this step."""
        prior = None
        rows = []
        for rid, n in zip(req_ids, num_drafted):
            if n <= 0:
                continue
            row = self._stale.get(rid)
            if row is None:
                if prior is None:
                    prior = self.estimator.prior_survival(self.K).cpu().numpy()
                row = prior
            rows.append(row[:n])
        return np.concatenate(rows) if rows else np.zeros(0)

    def admit(
        self,
        req_ids: list[str],
        features: torch.Tensor,
        num_drafted: np.ndarray,
        num_sampling: int,
        num_other_tokens: int,
    ) -> np.ndarray:
        """Decide how many drafts of each request to verify.

        req_ids: [R] request ids, in the rows' order.
        features: [R, K] lossless features of each drafted slot.
        num_drafted: [R] host ints; slots past it are not drafts (a request
            still in prefill, a short model-free draft).
        num_sampling: requests that will sample a token in the verify step.
        num_other_tokens: tokens of that step that are not drafts.
        Returns admitted [R] (host ints): a prefix length per request.
        """
        num_drafted = np.asarray(num_drafted, dtype=np.int64)
        R, k = features.shape
        budget = size_budget(
            self.stale_scores(req_ids, num_drafted),
            num_sampling=num_sampling,
            num_other_tokens=num_other_tokens,
            num_drafting_reqs=int((num_drafted > 0).sum()),
            cost=self.cost,
        )
        conf = self.estimator.predict(features)  # [R, k]
        surv = survival(conf)  # [R, k]
        drafted_t = torch.as_tensor(num_drafted, device=features.device)
        admitted = self.selector(surv, drafted_t, budget).cpu().numpy()  # [R]

        surv_np = surv.float().cpu().numpy()
        conf_np = conf.float().cpu().numpy()
        feats = features.detach()  # stays on its device for the estimator
        for r, rid in enumerate(req_ids):
            if num_drafted[r] <= 0:
                continue
            self._stale[rid] = surv_np[r]
            self._pending[rid] = _Pending(feats[r], conf_np[r], int(admitted[r]))

        s = self.stats
        s.num_steps += 1
        s.drafted += int(num_drafted.sum())
        s.admitted += int(admitted.sum())
        s.trimmed += int(num_drafted.sum() - admitted.sum())
        s.last_budget = int(budget)
        return admitted

    # ------------------------------------------------------------- observe
    def observe(
        self,
        req_ids: list[str],
        num_verified: np.ndarray,
        num_accepted: np.ndarray,
        learn: np.ndarray | None = None,
    ) -> None:
        """Feed back one verify step's outcomes.

        num_verified: [R] drafts actually verified per request (the engine
            may have cut our admission further, e.g. at max_model_len).
        num_accepted: [R] drafts accepted per request.
        learn: [R] bool, False for requests whose target distribution was
            changed by sampling transforms the drafter did not see
            (penalties, bad words, allowed tokens, grammars); their outcomes
            are counted but never fitted.
        """
        rows, n_ver, n_acc = [], [], []
        s = self.stats
        for r, rid in enumerate(req_ids):
            pending = self._pending.pop(rid, None)
            if pending is None or num_verified[r] <= 0:
                continue
            v = int(min(num_verified[r], pending.admitted))
            a = int(min(num_accepted[r], v))
            s.accepted += a
            if learn is not None and not learn[r]:
                continue
            rows.append(pending.features)
            n_ver.append(v)
            n_acc.append(a)
            # Calibration: labelled slots are the accepted ones plus the
            # first rejection if it was verified.
            n_lab = min(a + 1, v)
            s.predicted[:n_lab] += pending.conf[:n_lab]
            s.observed[:a] += 1.0
            s.labelled[:n_lab] += 1.0
        if rows:
            self.estimator.observe(
                torch.stack(rows),
                torch.tensor(n_ver),
                torch.tensor(n_acc),
            )

    def forget(self, req_ids) -> None:
        """Drop the state of finished or preempted requests."""
        for rid in req_ids:
            self._stale.pop(rid, None)
            self._pending.pop(rid, None)
