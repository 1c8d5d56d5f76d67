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
  by `AdaptiveVerifier.choose_depth` (the code the vLLM adapter runs).
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
from vllm_av.core.cost_model import CostModel
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

    def observe_draft_time(self, depth: int, num_reqs: int, ms: float) -> None:
        """The drafting time the step just paid (what the engine measures)."""

    def observe_verify_time(self, num_tokens: int, ms: float) -> None:
        """The rest of the step's time, at `num_tokens` target tokens."""


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

    def __init__(self, K: int, step_cost: StepCost, belief: CostModel | None = None,
                 calibrate: bool = True):
        """belief: the cost table the verifier plans with (a start-up
        profile, say) when it differs from what steps really cost
        (`step_cost`); calibrate: correct it from measured drafting and step
        times, as the engine does."""
        self.K = K
        # The verifier's own copy: calibration must not change the truth.
        model = CostModel.from_json((step_cost.model if belief is None else belief).to_json())
        # As shipped: a step of depth 0 skips the drafter.
        model.free_zero_depth = True
        self.verifier = AdaptiveVerifier(K, model)
        self.calibrate = calibrate

    def plan(self, req_ids, features, true_run):
        R = len(req_ids)
        drafted = np.full(R, self.K, dtype=np.int64)
        admitted = self.verifier.admit(
            req_ids, torch.from_numpy(features), drafted, num_sampling=R, num_other_tokens=R
        )
        return drafted, np.asarray(admitted, dtype=np.int64)

    def observe(self, req_ids, admitted, accepted):
        self.verifier.begin_step()  # the drafts just admitted are verified now
        self.verifier.observe(req_ids, admitted, accepted)

    def forget(self, req_ids):
        self.verifier.forget(req_ids)

    def observe_draft_time(self, depth, num_reqs, ms):
        if self.calibrate:
            self.verifier.observe_draft_time(depth, num_reqs, ms)

    def observe_verify_time(self, num_tokens, ms):
        if self.calibrate:
            self.verifier.observe_verify_time(num_tokens, ms)


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


class AdaptiveDepthAV(ShippedAV):
    """Ours plus a per-step drafting depth d in 0..K (the same d for all):
    `AdaptiveVerifier.choose_depth` before drafting (stale survival rows,
    drafting charged at depth d, periodic full-depth exploration; see its
    docstring), then `admit` as in ShippedAV on the d drafted slots."""

    name = "ours_adaptive_depth"

    def plan(self, req_ids, features, true_run):
        R = len(req_ids)
        d = self.verifier.choose_depth(req_ids, num_sampling=R, num_other_tokens=R)
        drafted = np.full(R, d, dtype=np.int64)
        if d == 0:
            return drafted, drafted.copy()
        # The trace has features for all K slots; admit reads only the d
        # drafted ones (the rest are filled with running means).
        admitted = self.verifier.admit(
            req_ids, torch.from_numpy(features), drafted, num_sampling=R, num_other_tokens=R
        )
        return drafted, np.asarray(admitted, dtype=np.int64)


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


def make_policy(name: str, K: int, step_cost: StepCost, belief: CostModel | None = None,
                calibrate: bool = True) -> Policy:
    """A fresh policy (new estimator state) by name; `belief`/`calibrate`
    apply to ours (see ShippedAV)."""
    if name == "no_spec":
        return NoSpec()
    if name.startswith("fixed_k"):
        return FixedK(int(name.removeprefix("fixed_k")))
    if name in ("ours", "ours_adaptive_depth"):
        cls = ShippedAV if name == "ours" else AdaptiveDepthAV
        return cls(K, step_cost, belief=belief, calibrate=calibrate)
    cls = {"reference_av": ReferenceAV, "oracle": Oracle}[name]
    return cls(K, step_cost)


__all__ = [
    "AdaptiveDepthAV", "FixedK", "NoSpec", "Oracle", "POLICY_ORDER", "Policy",
    "ReferenceAV", "ShippedAV", "make_policy",
]
