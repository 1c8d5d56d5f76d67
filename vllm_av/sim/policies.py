"""Verification policies the simulator compares.

A policy sees, per step, the batch's request ids and the features of the K
slots each request could draft ([R, K], logit(q_max) from the trace), and
returns how deep each request drafts and how many of those drafts are
verified (a prefix). Only the oracle reads `true_run` (the accepted run
length of the block each request would draft); every other policy decides
from features and past outcomes alone.

- `NoSpec`: draft nothing, one token per request per step.
- `FixedK(k)`: draft and verify k.
- `ReferenceAV`: DESIGN 2 written out with the upstream choices: budget from
  one-step-old survival with 1.0 for new requests, same online estimator
  and selector.
- `ShippedAV`: drives `vllm_av.core.verifier.AdaptiveVerifier`, the object
  the vLLM adapter uses (prior survival for new requests from the estimator).
- `AdaptiveDepthAV`: ShippedAV plus a drafting depth d <= K chosen per step
  from the stale survival rows (see its docstring).
- `Oracle`: knows each block's accepted run; drafts and verifies only
  accepted drafts, and per step picks how many of them to take (earliest
  positions first) to maximise tokens per ms, like the budget sizer would
  with perfect scores. It never verifies a rejected draft and never drafts
  one it will not verify.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_av.core.budget import size_budget
from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.selector import select_admitted
from vllm_av.core.survival import survival
from vllm_av.core.verifier import AdaptiveVerifier
from vllm_av.sim.costs import StepCost


class Policy:
    name = "policy"

    def plan(self, req_ids, features: np.ndarray, true_run: np.ndarray):
        """-> (drafted [R], admitted [R]) int arrays, admitted <= drafted <= K."""
        raise NotImplementedError

    def observe(self, req_ids, admitted: np.ndarray, accepted: np.ndarray) -> None:
        pass

    def forget(self, req_ids) -> None:
        pass


class NoSpec(Policy):
    name = "no_spec"

    def plan(self, req_ids, features, true_run):
        z = np.zeros(len(req_ids), dtype=np.int64)
        return z, z


class FixedK(Policy):
    def __init__(self, k: int):
        self.k = k
        self.name = f"fixed_k{k}"

    def plan(self, req_ids, features, true_run):
        d = np.full(len(req_ids), self.k, dtype=np.int64)
        return d, d


class ShippedAV(Policy):
    """The shipped AdaptiveVerifier, fresh estimator, K drafts per request."""

    name = "ours"

    def __init__(self, K: int, step_cost: StepCost):
        self.K = K
        self.verifier = AdaptiveVerifier(K, step_cost.model)

    def plan(self, req_ids, features, true_run):
        R = len(req_ids)
        drafted = np.full(R, self.K, dtype=np.int64)
        admitted = self.verifier.admit(
            req_ids, torch.from_numpy(features), drafted, num_sampling=R, num_other_tokens=R
        )
        return drafted, np.asarray(admitted, dtype=np.int64)

    def observe(self, req_ids, admitted, accepted):
        self.verifier.observe(req_ids, admitted, accepted)

    def forget(self, req_ids):
        self.verifier.forget(req_ids)


class ReferenceAV(Policy):
    """DESIGN 2 with upstream's prior: stale survival, 1.0 for new requests."""

    name = "reference_av"

    def __init__(self, K: int, step_cost: StepCost):
        self.K = K
        self.cost = step_cost.model
        self.estimator = OnlineAcceptanceEstimator(K)
        self.stale: dict[str, np.ndarray] = {}
        self.features: dict[str, torch.Tensor] = {}

    def plan(self, req_ids, features, true_run):
        R = len(req_ids)
        ones = np.ones(self.K)
        scores = np.concatenate([self.stale.get(r, ones) for r in req_ids])  # [R * K]
        budget = size_budget(scores, R, R, R, self.cost)
        feats = torch.from_numpy(features)  # [R, K]
        surv = survival(self.estimator.predict(feats))  # [R, K]
        drafted = np.full(R, self.K, dtype=np.int64)
        admitted = select_admitted(surv, torch.from_numpy(drafted), budget).numpy()
        surv_np = surv.numpy()
        for i, r in enumerate(req_ids):
            self.stale[r] = surv_np[i]
        self._feats = feats
        return drafted, admitted.astype(np.int64)

    def observe(self, req_ids, admitted, accepted):
        self.estimator.observe(self._feats, torch.from_numpy(admitted), torch.from_numpy(accepted))

    def forget(self, req_ids):
        for r in req_ids:
            self.stale.pop(r, None)


class _DepthScaledCost:
    """A CostModel view whose drafting step is `depth` forwards, not K."""

    def __init__(self, model, K: int):
        self.model, self.K, self.depth = model, K, K

    def draft_cost(self, num_reqs):
        if self.depth == 0:
            return 0.0 * np.asarray(num_reqs, dtype=np.float64)
        return self.model.draft_cost(num_reqs) * (self.depth / self.K)

    def verify_cost(self, num_tokens):
        return self.model.verify_cost(num_tokens)


class AdaptiveDepthAV(Policy):
    """Ours, plus a per-step drafting depth d in 0..K (the same d for all).

    Before drafting, for each d: B_d = size_budget(stale survival rows cut to
    depth d, drafting cost d/K of the table), and its expected rate
    (R + sum of the B_d best stale scores) / (draft_d + verify(R + B_d));
    draft the best d, then admit with the shipped verifier (whose sizer is
    charged the depth-d drafting cost). Undrafted slots have no features: we
    give them the running mean feature of drafted slots at that position, so
    next step's stale rows beyond d are the estimator's typical value, not
    information the drafter never produced. After a step that drafted
    nothing every row is a step older; we then size from the estimator's
    prior survival (its population average) instead, otherwise one bad step
    would freeze the depth at 0 (no drafts, no new rows, no learning).
    Exploration: every max(8, R // 2) steps the whole batch drafts all K
    (admission still by the budget). The estimator learns a position's
    intercept only from verified drafts there, so a policy that never drafts
    deep never learns that deep drafts pay (on the traces conditional
    acceptance rises with depth) and sticks at depth 1. Small batches need
    frequent exploration (few labels per step); at 256 requests one step in
    128 gives 256 labels per position for about 1/128 of a full drafting step.
    """

    # At least one refit window (8 steps) between exploration steps.
    EXPLORE_MIN_INTERVAL = 8

    name = "ours_adaptive_depth"

    def __init__(self, K: int, step_cost: StepCost):
        self.K = K
        self.cost = _DepthScaledCost(step_cost.model, K)
        self.verifier = AdaptiveVerifier(K, self.cost)
        self.feat_sum = np.zeros(K)
        self.feat_n = np.zeros(K)
        self.depths: list[int] = []
        self.since_explore = 0

    def _choose_depth(self, req_ids) -> int:
        R = len(req_ids)
        if self.depths and self.depths[-1] == 0:
            prior = self.verifier.estimator.prior_survival(self.K).numpy()
            rows = np.broadcast_to(prior, (R, self.K))
        else:
            rows = self.verifier.stale_scores(req_ids, np.full(R, self.K)).reshape(R, self.K)
        best_d, best_rate = 0, -1.0
        for d in range(self.K + 1):
            self.cost.depth = d
            s = rows[:, :d].ravel()
            B = size_budget(s, R, R, R if d else 0, self.cost)
            gain = R + (np.sort(s)[::-1][:B].sum() if B else 0.0)
            rate = gain / max(float(self.cost.draft_cost(R) + self.cost.verify_cost(R + B)), 1e-12)
            if rate > best_rate:
                best_d, best_rate = d, rate
        return best_d

    def plan(self, req_ids, features, true_run):
        R = len(req_ids)
        interval = max(self.EXPLORE_MIN_INTERVAL, R // 2)
        self.since_explore += 1
        if self.since_explore >= interval:
            self.since_explore, d = 0, self.K
        else:
            d = self._choose_depth(req_ids)
        self.cost.depth = d
        self.depths.append(d)
        drafted = np.full(R, d, dtype=np.int64)
        if d == 0:
            return drafted, drafted.copy()
        self.feat_sum[:d] += features[:, :d].sum(0)
        self.feat_n[:d] += R
        mean = np.where(self.feat_n > 0, self.feat_sum / np.maximum(self.feat_n, 1), 2.0)
        feats = features.copy()
        feats[:, d:] = mean[d:].astype(np.float32)
        admitted = self.verifier.admit(
            req_ids, torch.from_numpy(feats), drafted, num_sampling=R, num_other_tokens=R
        )
        return drafted, np.asarray(admitted, dtype=np.int64)

    def observe(self, req_ids, admitted, accepted):
        if self.cost.depth:
            self.verifier.observe(req_ids, admitted, accepted)

    def forget(self, req_ids):
        self.verifier.forget(req_ids)


class Oracle(Policy):
    """Perfect knowledge: draft and verify accepted drafts only, best rate per step."""

    name = "oracle"

    def __init__(self, K: int, step_cost: StepCost):
        self.K = K
        self.cost = step_cost

    def plan(self, req_ids, features, true_run):
        R, K = len(req_ids), self.K
        t = np.minimum(true_run, K)  # [R] accepted drafts available
        mask = t[:, None] > np.arange(K)  # [R, K]
        cnt = mask.sum(0)  # [K] requests reaching each depth
        start = np.concatenate([[0], np.cumsum(cnt)[:-1]])  # [K]
        B = np.arange(cnt.sum() + 1)[:, None]  # [N + 1, 1]
        # Taking the B earliest-position slots: n[b, j] slots at depth j.
        n = np.clip(B - start, 0, cnt)  # [N + 1, K]
        draft = self.cost.draft_fwd(n).sum(1)  # [N + 1]
        verify = self.cost.verify_ms(R + B[:, 0])
        rate = (R + B[:, 0]) / np.maximum(draft + verify, 1e-12)
        b = int(np.argmax(rate))
        taken = np.clip(b - start, 0, cnt)  # [K]
        rank = np.cumsum(mask, axis=0) - 1  # [R, K] index among requests at depth j
        admitted = (mask & (rank < taken)).sum(1).astype(np.int64)
        return admitted, admitted


POLICY_ORDER = (
    "no_spec", "fixed_k1", "fixed_k3", "fixed_k5", "fixed_k7",
    "reference_av", "ours", "ours_adaptive_depth", "oracle",
)


def make_policy(name: str, K: int, step_cost: StepCost) -> Policy:
    """A fresh policy (new estimator state) by name."""
    if name == "no_spec":
        return NoSpec()
    if name.startswith("fixed_k"):
        return FixedK(int(name.removeprefix("fixed_k")))
    cls = {
        "reference_av": ReferenceAV,
        "ours": ShippedAV,
        "ours_adaptive_depth": AdaptiveDepthAV,
        "oracle": Oracle,
    }[name]
    return cls(K, step_cost)


__all__ = [
    "AdaptiveDepthAV", "FixedK", "NoSpec", "Oracle", "POLICY_ORDER", "Policy",
    "ReferenceAV", "ShippedAV", "make_policy",
]
