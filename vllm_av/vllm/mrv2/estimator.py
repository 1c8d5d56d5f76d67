"""Our acceptance estimator behind the interface Model Runner V2's drafters call.

vLLM 0.32's `DraftModelSpeculator` (vllm/v1/worker/gpu/spec_decode/speculator.py)
builds `OnlineAcceptanceEstimator(max_num_reqs, num_speculative_steps, device)`
at load time and calls, per engine step:

  step(idx_mapping, num_sampled, num_rejected)
      before drafting (`observe_verification`), with the outcome of the drafts
      the target has just verified: num_sampled = accepted + 1 (0 for a chunked
      prefill), num_rejected = verified drafts that were not accepted.
  predict(logits, idx_mapping, draft_step, confidence_probs, temperature)
      while drafting, inside the drafter's captured CUDA graph: turn one draft
      step's logits into per-slot confidences, written at
      confidence_probs[batch row, draft step].

`AcceptanceEstimator` keeps that interface and delegates the science to the
core: the feature is `vllm_av.core.features.draft_features` (logit(q_max) of
the temperature-scaled draft distribution; it never reads the sampled token),
the model and its fit are `vllm_av.core.estimator.OnlineAcceptanceEstimator`.
On a GPU each call is one Triton kernel (`vllm_av.core.fused`): as torch
operations `predict` cost 0.36-0.57 ms and `step` 0.48-0.52 ms of host time
per call on the H200, against a 2 ms target step at one request.

CUDA graphs: `predict` is captured once and replayed, so everything it reads
or writes lives in buffers allocated here, never reassigned: the coefficients
are copied into `_coef` by the `step` that refitted them (our estimator
replaces its coefficient tensor at each refit, which a graph would not
see). Padded rows
(idx_mapping -1) write to a scratch row. No host sync anywhere.
"""

from __future__ import annotations

import weakref

import torch

from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.features import draft_features
from vllm_av.core.fused import fused_confidences

# The estimator built last on each device and not yet claimed by an AV
# manager. vLLM builds no handle from one to the other: the runner loads the
# speculator (which builds the estimator) before it builds the manager, so a
# manager claims the one built before it. Claimed once per engine: a manager
# whose drafter built none (a trained confidence head) must not pick up an
# earlier engine's estimator still alive in the same process.
_UNCLAIMED: dict[str, "weakref.ReferenceType[AcceptanceEstimator]"] = {}
# What an engine claimed is kept on its runner's request states (one object
# per runner, alive as long as it), under this name. With CUDA graphs vLLM
# 0.32 builds the manager twice (vllm/v1/worker/gpu/cudagraph_utils.py
# initializes the KV cache once to profile the graphs' memory, then again to
# serve), and both managers belong to the engine that built the one estimator.
_CLAIM_ATTR = "_vllm_av_claimed_estimator"


def _key(device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def claim_estimator(engine, device, max_num_reqs: int, num_speculative_steps: int
                    ) -> "AcceptanceEstimator | None":
    """The estimator built for this engine's drafter, or None (none was
    built, or the unclaimed one is of another shape: not this engine's).
    `engine` is the runner's request states: a second manager of the same
    engine gets what the first claimed."""
    if hasattr(engine, _CLAIM_ATTR):
        return getattr(engine, _CLAIM_ATTR)
    ref = _UNCLAIMED.pop(_key(device), None)
    est = ref() if ref is not None else None
    if est is not None and (est.max_num_reqs, est.num_speculative_steps) != (
            max_num_reqs, num_speculative_steps):
        est = None
    setattr(engine, _CLAIM_ATTR, est)  # lives with the runner anyway: its speculator holds it
    return est


class AcceptanceEstimator:
    """vLLM's MRV2 estimator interface over our online estimator."""

    def __init__(
        self,
        max_num_reqs: int,
        num_speculative_steps: int,
        device: torch.device,
        refit_interval: int | None = None,
    ):
        self.num_speculative_steps = K = num_speculative_steps
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)
        if refit_interval is None:
            refit_interval = _options_refit_interval()
        self.core = OnlineAcceptanceEstimator(K, refit_interval=refit_interval, device=self.device)
        # Feature of each draft slot by request-state slot; row max_num_reqs
        # is the scratch row that padded rows write to.
        self.features = torch.zeros(max_num_reqs + 1, K, dtype=torch.float32, device=self.device)
        # [w, b_0 .. b_{K-1}], refreshed in place after each refit.
        self._coef = self.core.coefficients.to(self.device).clone()
        self._coef_refits = self.core.num_refits
        # Scratch copy of the caller's confidence buffer (the speculator's
        # [max_num_reqs, K] float32 draft_token_confidence_probs) plus one
        # row; allocated here, not during graph capture.
        self._conf_scratch = torch.zeros(max_num_reqs + 1, K, dtype=torch.float32, device=self.device)
        # Accepted and verified drafts so far (device counters, for metrics).
        self.totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        # With adaptive depth, `step` runs only for steps whose drafts were
        # scheduled (`verifying`, set by our manager when it budgets them):
        # a step with no drafts has no outcome to learn from.
        self._only_verified = False
        self.verifying = False
        self._prior: tuple[int, torch.Tensor] | None = None  # (core refits, rates)
        _UNCLAIMED[_key(self.device)] = weakref.ref(self)

    def observe_only_verified_steps(self) -> None:
        self._only_verified = True

    def forget(self) -> None:
        """Back to the prior with nothing observed, counters at zero: vLLM's
        warm-up runs decode steps whose dummy drafts are verified (and
        nearly all accepted) through `step` before any request is served."""
        self.core.forget()
        self.totals.zero_()
        self.features.zero_()
        self._coef.copy_(self.core.coefficients)
        self._coef_refits = self.core.num_refits
        self._prior = None
        self.verifying = False

    # ------------------------------------------------------------- predict
    def predict(
        self,
        logits: torch.Tensor,  # [N, V] draft logits, pre-temperature
        idx_mapping: torch.Tensor,  # [N] request-state slot, -1 for padding
        draft_step: torch.Tensor,  # 0-d (one step for all rows) or [N]
        confidence_probs: torch.Tensor,  # [max_num_reqs, K] by batch row
        temperature: torch.Tensor,  # [max_num_reqs] by request-state slot
    ) -> None:
        if fused_confidences(logits, idx_mapping, draft_step, temperature, self._coef,
                             self.features, confidence_probs):
            return  # one kernel; the operations below are its reference
        N = logits.shape[0]
        K, R = self.num_speculative_steps, self.max_num_reqs
        dev = logits.device
        valid = idx_mapping >= 0  # [N]
        slot = torch.where(valid, idx_mapping, torch.full_like(idx_mapping, R)).long()
        rows = torch.arange(N, device=dev)
        if draft_step.dim() == 0:
            step = draft_step.reshape(1).long().expand(N)  # [N]
            batch_row = rows
        else:
            # Drafted in one pass: row i is request i // K's draft i % K.
            step = draft_step.reshape(-1).long()
            batch_row = torch.div(rows, K, rounding_mode="floor")
        temp = temperature.index_select(0, slot.clamp(max=R - 1))  # [N]
        feat = draft_features(logits, temp)  # [N]; never reads the sampled token
        self.features.index_put_((slot, step), feat)
        coef = self._coef
        prob = torch.sigmoid(coef[0] * feat + coef[1:].index_select(0, step))  # [N]
        # Padded rows (and rows past the buffer) go to the scratch row.
        scratch = self._scratch_for(confidence_probs)
        scratch[:R].copy_(confidence_probs)
        target = torch.where(valid & (batch_row < R), batch_row, torch.full_like(batch_row, R))
        scratch.index_put_((target, step), prob.to(scratch.dtype))
        confidence_probs.copy_(scratch[:R])

    def predict_features(
        self,
        features: torch.Tensor,  # [n, K] float32 by batch row, from a model-free drafter
        idx_mapping: torch.Tensor,  # [n] request-state slot, -1 for padding
        confidence_probs: torch.Tensor,  # [max_num_reqs, K] by batch row
    ) -> None:
        """`predict` for drafters with no draft distribution (ngram): the
        features come computed, one row per request, every position."""
        n = features.shape[0]
        R = self.max_num_reqs
        # Padded rows land in the scratch row R.
        slot = torch.where(idx_mapping >= 0, idx_mapping, torch.full_like(idx_mapping, R)).long()
        self.features.index_copy_(0, slot, features)
        coef = self._coef
        confidence_probs[:n].copy_(torch.sigmoid(coef[0] * features + coef[1:]))

    def _scratch_for(self, confidence_probs: torch.Tensor) -> torch.Tensor:
        s = self._conf_scratch
        if s is None or s.shape[1:] != confidence_probs.shape[1:] or s.dtype != confidence_probs.dtype:
            # Another buffer shape than expected: allocate (eager calls only).
            s = torch.zeros(
                confidence_probs.shape[0] + 1, *confidence_probs.shape[1:],
                dtype=confidence_probs.dtype, device=confidence_probs.device,
            )
            self._conf_scratch = s
        return s

    # ---------------------------------------------------------------- step
    def step(
        self,
        idx_mapping: torch.Tensor,  # [R] request-state slots of this batch
        num_sampled: torch.Tensor,  # [R] accepted + 1, 0 for a chunked prefill
        num_rejected: torch.Tensor,  # [R] verified drafts not accepted
    ) -> None:
        """Fit on the drafts the target has just verified (features recorded
        when they were drafted; `predict` overwrites them next)."""
        if self._only_verified:
            if not self.verifying:
                return
            self.verifying = False
        # Padding rows (idx_mapping -1) observe nothing; on a GPU one kernel.
        self.core.observe_sampled_rows(self.features, idx_mapping, num_sampled, num_rejected,
                                       totals=self.totals)
        if self.core.num_refits != self._coef_refits:  # the coefficients moved
            self._coef.copy_(self.core.coefficients)
            self._coef_refits = self.core.num_refits

    # --------------------------------------------------------------- prior
    def prior_confidences(self) -> torch.Tensor:
        """[K] conditional acceptance rates for a request with no history:
        the ratios of the core estimator's prior survival (on device).

        Computed once per refit of the core estimator and kept until the
        next (read-only: callers copy from it). The MRV2 manager copies it
        after each refit and the depth patch reads it for slots not
        drafted; recomputed at each call it was some twenty launches per
        step (`benchmarks/mrv2_step_launches.py`)."""
        refits = self.core.num_refits
        if self._prior is None or self._prior[0] != refits:
            surv = self.core.prior_survival(self.num_speculative_steps).float()  # [K]
            prev = torch.cat([surv.new_ones(1), surv[:-1]])
            rates = torch.where(prev > 0, surv / prev.clamp(min=1e-30), torch.zeros_like(surv))
            self._prior = (refits, rates)
        return self._prior[1]

    @property
    def coefficients(self) -> torch.Tensor:
        return self._coef


def _options_refit_interval() -> int:
    """Our refit interval from the config vLLM is building (our options ride
    in additional_config); the core default when none is current."""
    try:
        from vllm.config import get_current_vllm_config

        from vllm_av.vllm.config import av_options_of

        options = av_options_of(get_current_vllm_config())
    except Exception:  # noqa: BLE001 - no current config: defaults
        options = None
    if options is None:
        from vllm_av.core.estimator import DEFAULT_REFIT_INTERVAL

        return DEFAULT_REFIT_INTERVAL
    return options.refit_interval
