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

Adaptive drafting depth (`choose_depth`): before drafting, one depth d in
0..K for the whole batch, the d that maximises the expected rate
(N_sampling + sum of the B_d best stale scores cut to depth d) /
(draft_cost at depth d + verify_cost(T + B_d)), B_d the budget sized at that
depth. Like the budget, d is a function of stale scores and counts only,
never of this step's drafts, so it keeps verification lossless.

The class is engine-agnostic (numpy + torch); the vLLM adapter and the
simulator drive the same object, so the simulator measures the policy that
ships.

Order of calls per engine step: `begin_step` (the drafts admitted last step
are now being verified), then `observe` (their outcomes) and
`choose_depth` / `admit` (next step's drafts) in either order: vLLM's V1
runner drafts before its bookkeeping for model drafters and after it for
model-free ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_av.core.budget import best_budget, size_budget
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
    # Drafts the target actually verified (admitted ones that reached a
    # verify step; a request that finishes drops its last admitted drafts).
    verified: int = 0
    accepted: int = 0
    trimmed: int = 0
    last_budget: int = 0
    # Adaptive depth: the depth of the last step, the steps whose depth was
    # chosen, and how many of them drafted nothing.
    last_depth: int = 0
    depth_steps: int = 0
    zero_depth_steps: int = 0
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


# Exploration (choose_depth): at least one estimator refit window (8 steps)
# between two full-depth steps, and at most one in R // 2 steps. The
# estimator learns a position's intercept only from drafts verified there, so
# a policy that never drafts deep never learns that deep drafts pay (on the
# traces, conditional acceptance rises with depth) and sticks at depth 1 or
# 0. Small batches need frequent exploration (few labels per step); at 256
# requests one step in 128 gives 256 labels per position for about 1/128 of
# a full drafting step.
EXPLORE_MIN_INTERVAL = 8
# Feature (logit(q_max)) given to undrafted slots before any slot at that
# position was drafted: q_max = 0.88, a confident drafter.
UNDRAFTED_FEATURE = 2.0


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
        # Admitted drafts of the last `admit`, and of the one before it once
        # `begin_step` says they are being verified.
        self._pending: dict[str, _Pending] = {}
        self._verifying: dict[str, _Pending] = {}
        # Running sum and count of drafted features per position [K]; their
        # mean stands in for the features of slots a shallow step never drafted.
        self._feat_sum: torch.Tensor | None = None
        self._feat_n: torch.Tensor | None = None
        # Depth of the last chosen step (None before the first) and steps
        # since the last exploration step.
        self._last_depth: int | None = None
        self._since_explore = 0
        self.stats = VerifierStats(
            last_depth=self.K,
            predicted=np.zeros(self.K), observed=np.zeros(self.K), labelled=np.zeros(self.K),
        )

    # ---------------------------------------------------------------- depth
    def choose_depth(
        self,
        req_ids: list[str],
        num_sampling: int,
        num_other_tokens: int,
        min_depth: int = 0,
    ) -> int:
        """Drafting depth d in 0..K for this step, before anything is drafted.

        req_ids: the requests that will draft (decoding, not in prefill).
        num_sampling, num_other_tokens: as for `admit`.
        min_depth: a floor (the vLLM adapter drafts K when a request carries
            its own seed, so that its output depends on its seed alone).

        For each d the budget B_d is sized from the stale rows cut to depth
        d, with drafting charged at depth d (`CostModel.draft_cost_at_depth`),
        and d maximises the expected rate at B_d; ties go to the shallower d.
        Rows: each request's survival row from its previous drafting step
        (the estimator's prior for a new request); after a step that drafted
        nothing every row is a step older, so we take the estimator's prior
        (its population average) for all, or one bad step would freeze the
        depth at 0 (no drafts, no new rows, no learning). Every
        max(EXPLORE_MIN_INTERVAL, R // 2) steps the depth is K (exploration;
        the budget still decides what is verified). Takes no features: d
        never depends on this step's drafts.
        """
        R = len(req_ids)
        K = self.K
        if R == 0:
            return max(min_depth, 0)  # nothing decodes: drafts are discarded anyway
        self._since_explore += 1
        if self._since_explore >= max(EXPLORE_MIN_INTERVAL, R // 2):
            self._since_explore, d = 0, K
        else:
            d = self._best_depth(req_ids, num_sampling, num_other_tokens)
        d = int(min(max(d, min_depth), K))
        self._last_depth = d
        s = self.stats
        s.last_depth = d
        s.depth_steps += 1
        s.zero_depth_steps += int(d == 0)
        return d

    def _best_depth(self, req_ids, num_sampling: int, num_other_tokens: int) -> int:
        R, K = len(req_ids), self.K
        if self._last_depth == 0:
            prior = self.estimator.prior_survival(K).float().cpu().numpy()  # [K]
            rows = np.broadcast_to(prior, (R, K))
        else:
            rows = self.stale_scores(req_ids, np.full(R, K)).reshape(R, K)
        best_d, best_rate = 0, -1.0
        for d in range(K + 1):
            _, rate = best_budget(
                rows[:, :d].ravel(), num_sampling, num_other_tokens, R,
                self.cost.at_depth(d, K),
            )
            if rate > best_rate:
                best_d, best_rate = d, rate
        return best_d

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
        # Drafter passes this step: the deepest draft (K unless a depth was chosen).
        depth = int(num_drafted.max()) if R else 0
        budget = size_budget(
            self.stale_scores(req_ids, num_drafted),
            num_sampling=num_sampling,
            num_other_tokens=num_other_tokens,
            num_drafting_reqs=int((num_drafted > 0).sum()),
            cost=self.cost.at_depth(depth, self.K),
        )
        drafted_t = torch.as_tensor(num_drafted, device=features.device)
        features = self._fill_undrafted(features, drafted_t)
        conf = self.estimator.predict(features)  # [R, k]
        surv = survival(conf)  # [R, k]
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

    def _fill_undrafted(self, features: torch.Tensor, num_drafted: torch.Tensor) -> torch.Tensor:
        """Features [R, k] with slots past each row's draft replaced by the
        running mean feature of drafted slots at that position.

        Those slots were never drafted (a shallow step, a short model-free
        draft) and their stored features are placeholders; the mean makes
        next step's stale row beyond them the estimator's typical value, not
        information the drafter never produced. Drafted slots are unchanged,
        so admission is not affected. On the features' device, no sync.
        """
        R, k = features.shape
        drafted = torch.arange(k, device=features.device) < num_drafted[:, None]  # [R, k]
        if self._feat_sum is None or self._feat_sum.device != features.device:
            self._feat_sum = torch.zeros(k, dtype=torch.float64, device=features.device)
            self._feat_n = torch.zeros(k, dtype=torch.float64, device=features.device)
        self._feat_sum += torch.where(drafted, features, 0.0).sum(0, dtype=torch.float64)
        self._feat_n += drafted.sum(0, dtype=torch.float64)
        mean = torch.where(
            self._feat_n > 0, self._feat_sum / self._feat_n.clamp(min=1.0), UNDRAFTED_FEATURE
        ).to(features.dtype)  # [k]
        return torch.where(drafted, features, mean)

    # ------------------------------------------------------------- observe
    def begin_step(self) -> None:
        """The drafts admitted so far are being verified in this step: the
        next `observe` reads them, the next `admit` starts a new set. Without
        it an engine that drafts before its bookkeeping (vLLM's V1 runner
        with model drafters) would pair this step's outcomes with the
        features of the drafts it has just admitted for the next step."""
        self._verifying = self._pending
        self._pending = {}

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
            pending = self._verifying.pop(rid, None)
            if pending is None or num_verified[r] <= 0:
                continue
            v = int(min(num_verified[r], pending.admitted))
            a = int(min(num_accepted[r], v))
            s.verified += v
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
            self._verifying.pop(rid, None)
