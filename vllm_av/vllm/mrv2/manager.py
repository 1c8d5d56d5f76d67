"""Our adaptive-verification manager for vLLM 0.32's Model Runner V2.

Drop-in for `vllm.v1.worker.gpu.spec_decode.adaptive_verification.
AdaptiveVerificationManager`: the same constructor and methods, called from
the same places of `vllm/v1/worker/gpu/model_runner.py`; the budget, the
selection and the cost model are ours (vllm_av.core). Per engine step:

  record_confidences   after drafting: this step's confidences by request
                       slot (device), and an asynchronous copy to the host
                       that a LATER step's budget reads (double-buffered).
  get_num_tokens       next step, on the host: B* = size_budget(stale survival
                       scores, ...) with our CostModel; returns the step's
                       token count (known on the host, so a CUDA graph of that
                       size can be picked).
  compact_batch        host placeholder layout (B spread evenly); the true
                       per-request split is decided on the device.
  reallocate_drafts    on the device, no host sync: select_admitted over the
                       CURRENT survival (ties: earlier position, then lower
                       batch row) -> per-request admitted prefix, cu_num_logits
                       and query_start_loc for the varlen verify.

Losslessness (DESIGN 2.5): B depends only on confidences of drafts made one
step before the drafts being verified (or the estimator's prior for a new
request) and on counts fixed before drafting; slot i's admission then depends
only on slots that outrank it, none of which is a function of draft token x_i.

Start-up: `batches_to_profile` lists dummy steps at every captured size and a
few above (our profile_context_len and profile_repeats), and
`set_initial_cost_curves` builds `CostModel.from_samples` from their timings
(drafter timings from full-graph replays only); VLLM_AV_COST_TABLE loads a
saved table instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from vllm_av.core.budget import size_budget
from vllm_av.core.cost_model import CostModel
from vllm_av.core.selector import DevicePrefixSums, compiled_select_admitted, select_admitted
from vllm_av.core.survival import survival
from vllm_av.core.transfer import host_to_device
from vllm_av.core.verifier import record_depth
from vllm_av.vllm.config import AVOptions
from vllm_av.vllm.mrv1.scheduled_depth import register_local_verifier
from vllm_av.vllm.mrv2.depth import MRV2DepthPolicy, drafter_skipped
from vllm_av.vllm.mrv2.estimator import claim_estimator
from vllm_av.vllm.mrv2.catch_up import (bind_token_history, positions_caught_up,
                                        positions_left_as_holes)

logger = logging.getLogger("vllm.vllm_av")

# A period between two scheduled steps longer than this many times the
# priced step is an idle gap (no requests, waiting on the API server), not
# a step.
STEP_PERIOD_MAX_RATIO = 8.0


@dataclass
class ManagerStats:
    """Host-side totals (admitted drafts are all verified on MRV2)."""

    num_steps: int = 0
    drafted: int = 0
    admitted: int = 0
    trimmed: int = 0
    last_budget: int = 0
    # From the device counters, as of the last landed copy (one step old).
    accepted: int = 0
    verified: int = 0
    coefficients: list = field(default_factory=list)
    # Drafting depths chosen (adaptive depth; last_depth -1: none yet).
    depth_steps: int = 0
    zero_depth_steps: int = 0
    last_depth: int = -1
    depth_counts: list = field(default_factory=list)  # steps at each depth 0..K
    # What scored the drafts: our estimator, or the drafter's trained
    # confidence head (DSpark), with which accepted / verified and the
    # estimator's coefficients are not counted here (vLLM's spec-decode
    # metrics still count acceptance).
    confidence_source: str = "estimator"


class _StaleSlot:
    """One of the two host copies: a stats vector (accepted, verified, the
    estimator's K + 1 coefficients; float64) and [R + 1, K] confidences by
    request slot (row R: the prior's conditional rates; float32), laid end
    to end in one buffer so that a record is one device-to-host copy."""

    def __init__(self, R: int, K: int, device: torch.device, pinned: bool) -> None:
        stats_bytes, conf_bytes = 8 * (K + 3), 4 * (R + 1) * K
        self.dev_bytes = torch.zeros(stats_bytes + conf_bytes, dtype=torch.uint8, device=device)
        self.host_bytes = torch.zeros(stats_bytes + conf_bytes, dtype=torch.uint8, pin_memory=pinned)

        def views(buf):
            return (buf[:stats_bytes].view(torch.float64),
                    buf[stats_bytes:].view(torch.float32).view(R + 1, K))

        self.stats_dev, self.dev = views(self.dev_bytes)
        self.stats_host, self.host = views(self.host_bytes)
        self.dev.fill_(1.0)
        self.host.fill_(1.0)
        self.np = self.host.numpy()
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.step = -1  # record step whose data this slot holds
        self.refits = -1  # estimator refit whose prior and coefficients it holds


def _draft_samples(samples) -> dict[int, list[float]]:
    """Drafting time per request count, from full-graph steps only: after a
    target step run without graphs, the drafter's measured time includes
    waiting for the host to finish launching that step."""
    draft: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        if s.full_cudagraph:
            draft[int(s.num_reqs)].append(float(s.drafter_ms))
    return draft


def _host_offsets(counts: np.ndarray) -> np.ndarray:
    """[0, c0, c0 + c1, ...] of host counts."""
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _sync_allowed():
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        return gpu_sync_allowed()
    except ImportError:  # pragma: no cover - older vLLM
        return contextlib.nullcontext()


def _sizes_above(top: int, max_tokens: int) -> list[int]:
    """Token counts to profile past the largest captured size `top`: half as
    much again, then each doubling, all capped at max_tokens (served steps
    up there run without full graphs, and their cost does not follow from
    the captured ones)."""
    if not top:
        return []
    doublings = [top << i for i in range(1, max(1, max_tokens // top).bit_length() + 1)]
    return sorted({min(n, max_tokens) for n in [top + top // 2, *doublings]})


class AVManager:
    """Same interface as vLLM 0.32's AdaptiveVerificationManager."""

    def __init__(
        self,
        req_states,
        query_start_loc: torch.Tensor,
        num_bonus_tokens: int,
        max_total_logits: int,
        options: AVOptions | None = None,
        rank: int = 0,
        parallel_drafter: bool = False,
        draft_model: bool = False,
        first_forward_at_zero: bool = False,
    ):
        self.req_states = req_states
        if options is not None and options.drafter_catch_up:
            # The drafter's catch-up reads missed positions' tokens there.
            bind_token_history(req_states.all_token_ids)
        self.num_speculative_steps = K = req_states.num_speculative_steps
        self.device = device = torch.device(req_states.device)
        self.num_bonus_tokens = num_bonus_tokens
        self._max_total_logits = max_total_logits
        self.query_start_loc = query_start_loc
        self.options = options or AVOptions()
        self.rank = rank
        # A drafter that proposes all K at once (ngram): any depth above 0
        # costs its whole drafting step, and only depth 0 saves it.
        self.parallel_drafter = parallel_drafter
        # A drafter fed by the target's hidden states (EAGLE, MTP): its first
        # forward runs at every depth, 0 included, over the step's accepted
        # tokens (MRV2TargetDrafterDepthPatch), so depth 0 is priced as it.
        self.first_forward_at_zero = first_forward_at_zero
        # An autoregressive drafter stopped at the depth it is given (a
        # separate draft model, MRV2DraftDepthPatch; EAGLE / MTP): with
        # adaptive depth its drafting is also profiled at depth 1, whose
        # first forward costs more than 1/K of a K-deep step.
        self.profile_depth_one = bool((draft_model or first_forward_at_zero)
                                      and self.options.scheduled_depth and K > 1)
        self._profiled = (0, 0)  # dummy runs yielded at depth K, then at depth 1
        self.cost: CostModel | None = None
        if self.options.cost_table:
            with open(self.options.cost_table) as f:
                self.cost = CostModel.from_json(f.read())
        self._cudagraph_limit = 0
        self._capture_sizes: list[int] = []
        self.R = R = req_states.max_num_reqs
        self._est = claim_estimator(req_states, device, R, K)
        cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        # Current confidences by request slot (device).
        self._conf = torch.ones(R, K, dtype=torch.float32, device=device)
        self._conf_rows = torch.ones_like(self._conf)  # by batch row, for the selector
        self._drafted = torch.zeros(R, dtype=torch.int32, device=device)
        self._non_draft = torch.zeros(R, dtype=torch.int32, device=device)
        # Admitted drafts [R], cu_num_logits and a staged query_start_loc
        # (each the length L of vLLM's query_start_loc), end to end: a layout
        # known on the host goes over in one copy.
        L = query_start_loc.numel()
        self._layout = torch.zeros(R + 2 * L, dtype=query_start_loc.dtype, device=device)
        self._layout_host = np.zeros(R + 2 * L, dtype=np.int64)
        self._admitted = self._layout[:R]
        self._cu_num_logits = self._layout[R : R + L]
        self._staged_query_start_loc = self._layout[R + L :]
        self._prefix_sums = DevicePrefixSums(R, device)
        self._slots = [_StaleSlot(R, K, device, pinned=cuda) for _ in range(2)]
        self._stale_idx = 0
        self._record_step = 0
        # Record step of each request slot's first confidences (inf: none yet).
        self._first_record = np.full(R, np.iinfo(np.int64).max, dtype=np.int64)
        self._batch: tuple | None = None
        self._select = compiled_select_admitted() if cuda else select_admitted
        self.stats = ManagerStats()
        # Adaptive drafting depth (set up with the cost tables) and the
        # prior's survival last handed to it.
        self.depth = None
        self._prior_cache: tuple | None = None
        # The prior with no estimator, one array for every call: the depth
        # choice's memo holds while the prior it reads is the same object.
        self._ones_prior = np.ones(K)
        self._ones_prior.flags.writeable = False
        self._ticks = 0  # metric snapshots: one per metrics_interval ticks
        # The estimator told which steps carry labels (adaptive depth only).
        self._labelled = None
        # (time, depth, requests) of the last scheduled step whose period
        # may correct the costs (option step_period_calibration).
        self._last_scheduled: tuple | None = None

    # ------------------------------------------------------------ requests
    def add_request(self, req_idx: int) -> None:
        """A new request in slot `req_idx`: until its own confidences reach
        the host, the budget scores it with the estimator's prior."""
        self._first_record[req_idx] = np.iinfo(np.int64).max
        self._conf[req_idx].fill_(1.0)

    # ----------------------------------------------------------- profiling
    def batches_to_profile(self, capture_sizes: list[int]):
        """Dummy-run kwargs (num_tokens, context_len) whose step timings
        become the cost tables: every captured size, then a few above the
        largest (see _sizes_above)."""
        self._capture_sizes = captured = sorted(capture_sizes)
        self._cudagraph_limit = top = captured[-1] if captured else 0
        above = _sizes_above(top, self.req_states.max_num_batched_tokens)
        sizes = captured + [n for n in above if n not in captured]
        reps, ctx = self.options.profile_repeats, self.options.profile_context_len
        self._profiled = (len(sizes) * reps, 0)
        for num_tokens in sizes:
            for _ in range(reps):
                yield {"num_tokens": num_tokens, "context_len": ctx}
        if not self.profile_depth_one:
            return
        # Then the drafter at depth 1 (one dummy run's requests: at most
        # max_num_reqs, so larger sizes add nothing).
        from vllm_av.vllm.mrv2.depth import set_profile_depth

        shallow = [n for n in sizes if n <= self.R] or sizes[:1]
        self._profiled = (len(sizes) * reps, len(shallow) * reps)
        set_profile_depth(1)
        try:
            for num_tokens in shallow:
                for _ in range(reps):
                    yield {"num_tokens": num_tokens, "context_len": ctx}
        finally:
            set_profile_depth(None)

    def set_initial_cost_curves(self, samples) -> None:
        """`samples`: vLLM StepTimingSample (forward_ms, drafter_ms,
        num_target_tokens, num_reqs, full_cudagraph) of the profiled runs."""
        samples = list(samples)
        at_k, at_one = self._profiled
        shallow_runs: list = []
        if at_one and len(samples) == at_k + at_one:
            samples, shallow_runs = samples[:at_k], samples[at_k:]
        elif at_one:
            logger.warning("vllm-av (MRV2): %d profile timings for %d dummy runs; drafting "
                           "priced from depth K alone", len(samples), at_k + at_one)
            samples = samples[:at_k]
        verify: dict[int, list[float]] = defaultdict(list)
        for s in samples:
            verify[int(s.num_target_tokens)].append(float(s.forward_ms))
        draft = _draft_samples(samples)
        by_depth = None
        if shallow_runs:
            by_depth = [(1, sorted(_draft_samples(shallow_runs).items())),
                        (self.num_speculative_steps, sorted(draft.items()))]
        self.set_cost_curves(sorted(draft.items()), sorted(verify.items()),
                             draft_by_depth=by_depth)

    def set_cost_curves(self, draft_curve, verify_curve, draft_by_depth=None) -> None:
        """Curves as (size, ms) or (size, [ms, ...]) pairs; `draft_by_depth`:
        (depth, draft curve) pairs. Every TP rank must size the same budget,
        so rank 0's curves are broadcast."""
        try:
            from vllm.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
        except (AssertionError, ImportError, RuntimeError):
            tp = None  # no TP group (tests, single process)
        if tp is not None:
            draft_curve, verify_curve, draft_by_depth = tp.broadcast_object(
                (list(draft_curve), list(verify_curve), draft_by_depth), src=0)
        if self.options.cost_table and self.cost is not None:
            logger.info("vllm-av (MRV2): %s (from %s)", self.cost.summary(), self.options.cost_table)
        else:
            if len(draft_curve) == 0 or len(verify_curve) == 0:
                raise RuntimeError(
                    "vllm-av: adaptive verification could not profile step costs; "
                    "set VLLM_AV_COST_TABLE to a saved table, or remove "
                    "enable_adaptive_verification from the speculative config"
                )

            def samples(curve):
                return {int(n): (list(v) if isinstance(v, (list, tuple)) else [float(v)])
                        for n, v in curve}

            self.cost = CostModel.from_samples(
                samples(verify_curve), samples(draft_curve), graph_sizes=self._capture_sizes,
                draft_by_depth={d: samples(c) for d, c in draft_by_depth or ()} or None,
            )
            logger.info("vllm-av (MRV2): %s", self.cost.summary())
        # Serving starts after these tables: what the estimator saw so far
        # were vLLM's warm-up steps (dummy drafts, nearly all accepted).
        est = self._estimator()
        if est is not None:
            est.forget()
        if self.options.scheduled_depth and self.depth is None:
            self._start_depth_policy()
        elif self.depth is not None:
            self.depth.cost = self.cost
        out = os.environ.get("VLLM_AV_COST_TABLE_OUT")
        if out and self.rank == 0:
            with open(out, "w") as f:
                f.write(self.cost.to_json())
        self._warm_admission()

    def forget_warmup(self) -> None:
        """After warm-up steps run with our AV on (served_warmup.py): the
        estimator back to its prior, no landed confidences, counters at
        zero, so that serving starts as it would have without them."""
        est = self._estimator()
        if est is not None:
            est.forget()
        for slot in self._slots:
            if slot.event is not None:
                slot.event.synchronize()
            slot.dev.fill_(1.0)
            slot.host.fill_(1.0)
            slot.step = slot.refits = -1
        self._first_record.fill(np.iinfo(np.int64).max)
        self._conf.fill_(1.0)
        self._batch = self._prior_cache = self._last_scheduled = None
        self.stats = ManagerStats()
        self._ticks = 0

    def _warm_admission(self) -> None:
        """Run the device admission (`_admit_on_device`) once now, on the
        buffers served steps use, so that the first served step that trims
        compiles and loads nothing. The compiled selector guards on its
        inputs' dispatch keys, which differ between a tensor made in
        inference mode (a fresh one here) and the manager's buffers (made
        outside it): a warm call on fresh tensors left a recompile to the
        first trimmed step (docs/RESULTS.md, forty-first round). The layout
        goes to a scratch query_start_loc: vLLM's is not ours to write."""
        n, K = self.R, self.num_speculative_steps
        with torch.inference_mode():  # as vLLM's execute_model
            idx = torch.arange(n, dtype=torch.int32, device=self.device)
            scratch = torch.zeros_like(self.query_start_loc)
            self._admit_on_device(idx, np.full(n, K), np.ones(n, dtype=np.int64), 1, n + 1,
                                  scratch)
            self._layout.zero_()
            self._drafted.zero_()
            self._non_draft.zero_()
            self._conf_rows.fill_(1.0)

    # ------------------------------------------------------------ per step
    def record_confidences(self, confidence_probs: torch.Tensor, input_batch) -> None:
        """This step's confidences [>= num_reqs, K] by batch row: keep them
        for the next step's selection and start their copy to the host."""
        if drafter_skipped():
            # Depth 0: nothing drafted. Waiting here for the last copy would
            # hold the host to the device every plain step.
            return
        n = input_batch.num_reqs
        # The copy started one step ago becomes what budgets read; the copy
        # budgets were reading is free to be overwritten by this step's.
        landed, out = self._slots[1 - self._stale_idx], self._slots[self._stale_idx]
        if landed.event is not None:
            with _sync_allowed():
                landed.event.synchronize()  # started a whole step ago: done
        self._stale_idx = 1 - self._stale_idx
        self._land_stats(landed)

        self._conf[input_batch.idx_mapping] = confidence_probs[:n].float()
        idx = np.asarray(input_batch.idx_mapping_np[:n], dtype=np.int64)
        self._first_record[idx] = np.minimum(self._first_record[idx], self._record_step)

        out.dev[: self.R].copy_(self._conf)
        est = self._estimator()
        if est is not None:
            out.stats_dev[:2].copy_(est.totals)
            refits = est.core.num_refits
            if out.refits != refits:  # the prior and coefficients move at refits only
                out.dev[self.R].copy_(est.prior_confidences())
                out.stats_dev[2:].copy_(est.coefficients)
                out.refits = refits
        else:
            # A trained confidence head (DSpark; vLLM then builds no
            # estimator): a request not yet recorded is budgeted at this
            # step's mean confidence per position, not as a sure accept.
            out.dev[self.R].copy_(confidence_probs[:n].float().mean(0))
            self.stats.confidence_source = "head"
        out.step = self._record_step
        self._record_step += 1
        if self._copy_stream is None:
            out.host_bytes.copy_(out.dev_bytes)
            return
        main = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(main)
        with torch.cuda.stream(self._copy_stream):
            out.host_bytes.copy_(out.dev_bytes, non_blocking=True)
            out.event.record()

    def _estimator(self):
        """Our estimator in this engine's drafter; None with a trained
        confidence head, where vLLM builds none."""
        return self._est

    def _land_stats(self, slot: _StaleSlot) -> None:
        if slot.step < 0 or self.stats.confidence_source != "estimator":
            return
        s = slot.stats_host.numpy()
        self.stats.accepted, self.stats.verified = int(s[0]), int(s[1])
        self.stats.coefficients = s[2:].tolist()

    def _stale_conf(self, slots: np.ndarray) -> np.ndarray:
        """[n, K] confidences of request slots `slots` from the landed host
        copy; a slot with none of its own there (new, or -1: not yet in the
        runner's states) gets the prior's row."""
        stale = self._slots[self._stale_idx]
        known = slots >= 0
        conf = stale.np[np.where(known, slots, self.R)].astype(np.float64)
        fresh = known & (self._first_record[np.maximum(slots, 0)] > stale.step)
        if fresh.any():
            conf[fresh] = stale.np[self.R]
        return conf

    # --------------------------------------------------------------- depth
    def stale_survival(self, req_ids) -> np.ndarray:
        """[R, K] survival rows of requests `req_ids` from the landed host
        copy (the drafting depth's input: no sync, one step old)."""
        get = self.req_states.req_id_to_index.get
        slots = np.fromiter((get(r, -1) for r in req_ids), dtype=np.int64, count=len(req_ids))
        return survival(self._stale_conf(slots))

    def prior_survival_host(self) -> np.ndarray:
        """[K] prior survival on the host: from the landed copy's prior row
        once one has landed (the same array while it is unchanged, so that
        the depth choice's memo holds), else from the estimator."""
        stale = self._slots[self._stale_idx]
        if stale.step < 0:
            est = self._estimator()
            if est is None:
                return self._ones_prior
            return est.core.prior_survival_host(self.num_speculative_steps)
        # A landed slot's row changes only when a later record lands in it:
        # while no step records (a run of depth-0 steps), the slot and its
        # step say that it is unchanged without reading it.
        key = (self._stale_idx, stale.step, stale.refits)
        cached = self._prior_cache
        if cached is not None and cached[0] == key:
            return cached[2]
        row = stale.np[self.R]
        if cached is None or not np.array_equal(cached[1], row):
            prior = survival(row[None].astype(np.float64))[0]
            prior.flags.writeable = False
            cached = (key, row.copy(), prior)
        else:
            cached = (key, cached[1], cached[2])
        self._prior_cache = cached
        return cached[2]

    def choose_depth(self, req_ids: list[str], num_sampling: int, num_other_tokens: int,
                     min_depth: int = 0, may_explore: bool = True) -> int:
        """The drafting depth of the step being scheduled (called by the
        scheduler through `DepthFromVerifier`, mrv1/scheduled_depth.py):
        the core's choice over stale rows and profiled costs; K until the
        cost tables exist."""
        if self.depth is None:
            return self.num_speculative_steps
        fixed = self.options.test_fixed_depth
        if fixed >= 0:  # a measurement control (options.test_fixed_depth)
            d = min(max(fixed, min_depth), self.num_speculative_steps)
        else:
            d = self.depth.choose_depth(req_ids, num_sampling, num_other_tokens, min_depth,
                                        may_explore=may_explore)
        if self.options.step_period_calibration:
            self._observe_period(len(req_ids), d, steady=may_explore)
        # Counted here, where the depth is handed to the step (not from the
        # policy's own counts): what /metrics shows is what the steps ran.
        record_depth(self.stats, d, self.num_speculative_steps)
        self._maybe_write_metrics()
        return d

    def _observe_period(self, num_reqs: int, depth: int, steady: bool) -> None:
        """Under async scheduling the scheduler asks for a depth once per
        step, so the time since the last ask is the last step's period. It
        corrects the costs (`observe_step_period`) when both steps decoded
        the same requests with no prompt tokens, and the period is not an
        idle gap (at most STEP_PERIOD_MAX_RATIO times the priced step)."""
        now = time.perf_counter()
        last, self._last_scheduled = self._last_scheduled, (
            (now, depth, num_reqs) if steady else None)
        if last is None or not steady or last[2] != num_reqs:
            return
        t0, d0, n0 = last
        K = self.num_speculative_steps
        priced = (float(self.cost.verify_cost(n0 * (1 + d0), plain=d0 == 0))
                  + float(self.cost.draft_cost_at_depth(n0, d0, K)))
        ms = (now - t0) * 1e3
        if ms <= STEP_PERIOD_MAX_RATIO * priced:
            self.depth.observe_step_period(d0, n0, ms)

    def _start_depth_policy(self) -> None:
        """Adaptive depth (options.scheduled_depth): depth 0 skips the
        drafter on V2 (MRV2DraftDepthPatch), so it is priced free, or runs
        its first forward alone (option zero_depth_skips_drafter off, or an
        EAGLE / MTP drafter), priced as that forward; the scheduler finds
        this manager as its process's verifier."""
        skips = ((self.options.zero_depth_skips_drafter or self.parallel_drafter)
                 and not self.first_forward_at_zero)
        self.cost.free_zero_depth = skips
        self.cost.zero_depth_forward = not skips
        if self.parallel_drafter:
            self.cost.draft_by_depth = {1: self.cost.draft}  # every depth > 0: all K
        self.depth = MRV2DepthPolicy(self)
        self._labelled = est = self._estimator()
        if est is not None:
            est.observe_only_verified_steps()
        register_local_verifier(self)
        logger.info("vllm-av (MRV2): drafting depth chosen when scheduled (0..%d)",
                    self.num_speculative_steps)

    def get_num_tokens(self, num_tokens_per_req: dict, draft_tokens: dict) -> int:
        """Size the draft budget B (host, stale scores) and return the step's
        token count: its non-draft tokens plus B."""
        if self.cost is None:
            raise RuntimeError("vllm-av: MRV2 AV manager used before its cost tables were built")
        req_ids = list(num_tokens_per_req)
        n = len(req_ids)
        tokens = np.fromiter(num_tokens_per_req.values(), dtype=np.int64, count=n)
        drafts = np.fromiter((len(draft_tokens.get(r, ())) for r in req_ids), dtype=np.int64, count=n)
        drafts = np.minimum(drafts, self.num_speculative_steps)
        non_draft = tokens - drafts
        slot_of = self.req_states.req_id_to_index
        slots = np.array([slot_of[r] for r in req_ids], dtype=np.int64)
        conf = self._stale_conf(slots)  # [n, K]
        scores = survival(conf)[np.arange(self.num_speculative_steps) < drafts[:, None]]
        # A request samples this step once its prompt is through after it.
        done_after = self.req_states.num_computed_tokens_np[slots] + non_draft
        num_sampling = int((done_after >= self.req_states.prefill_len.np[slots]).sum())
        num_drafts, num_own = int(drafts.sum()), int(non_draft.sum())
        # All logits of a step must fit the sampler's single chunk: a
        # compacted (trimmed) layout cannot be split across chunks.
        room = self._max_total_logits - n * self.num_bonus_tokens
        budget = size_budget(
            scores, num_sampling=num_sampling, num_other_tokens=num_own,
            num_drafting_reqs=n, cost=self.cost, max_budget=min(num_drafts, max(0, room)),
        )
        self._batch = ({r: i for i, r in enumerate(req_ids)}, drafts, non_draft, budget)
        if self._labelled is not None:
            self._labelled.verifying = True  # this step verifies drafts: its outcomes are labels
        st = self.stats
        st.num_steps += 1
        st.drafted += num_drafts
        st.admitted += budget
        st.trimmed += num_drafts - budget
        st.last_budget = budget
        self._maybe_write_metrics()
        return num_own + budget

    def compact_batch(
        self,
        num_draft_tokens_per_req: np.ndarray,
        num_scheduled_tokens: np.ndarray,
        cu_num_logits_np: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host-side token counts once the budget B is known. The device
        picks which slots verify; the host needs only a layout with the
        right total: each request's own tokens plus B dealt round-robin over
        the requests that drafted (they lead the batch). cu_num_logits stays
        an upper bound, except at B = 0: one logit per request."""
        assert self._batch is not None
        budget = self._batch[3]
        drafts = np.asarray(num_draft_tokens_per_req)
        if budget == int(drafts.sum()):
            return num_scheduled_tokens, cu_num_logits_np
        own = num_scheduled_tokens - drafts
        if budget == 0:
            ends = np.arange(own.size + 1, dtype=cu_num_logits_np.dtype)
            return own, ends * self.num_bonus_tokens
        drafted = np.flatnonzero(drafts)
        v = drafted.size
        assert v and drafted[-1] == v - 1, "requests that drafted must lead the batch"
        dealt = np.zeros_like(own)
        dealt[:v] = (budget + v - 1 - np.arange(v)) // v  # sums to B, first B % v get one more
        return own + dealt, cu_num_logits_np

    def reallocate_drafts(self, req_ids: list[str], idx_mapping: torch.Tensor):
        """Admit the B best current slots on the device and lay out the
        verify batch. Returns (cu_num_logits [n + 1], query_start_loc
        [max_num_reqs + 1], B)."""
        batch, self._batch = self._batch, None
        assert batch is not None
        row_of, drafts_all, non_draft_all, budget = batch
        order = np.fromiter((row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        drafts, non_draft = drafts_all[order], non_draft_all[order]
        n = idx_mapping.shape[0]
        num_tokens = int(non_draft.sum()) + budget
        if budget == 0 or budget == int(drafts.sum()):
            # Every draft or none: the layout is known here, so it goes over
            # with the step's other host inputs (one copy, then one into
            # vLLM's query_start_loc); no device work to wait on.
            self._send_layout(drafts if budget else np.zeros_like(drafts), non_draft, num_tokens)
            return self._cu_num_logits[: n + 1], self.query_start_loc, budget
        logits = self._admit_on_device(idx_mapping, drafts, non_draft, budget, num_tokens,
                                       self.query_start_loc)
        return logits, self.query_start_loc, budget

    def _admit_on_device(self, idx_mapping: torch.Tensor, drafts: np.ndarray,
                         non_draft: np.ndarray, budget: int, num_tokens: int,
                         query_start_loc: torch.Tensor) -> torch.Tensor:
        """The top-`budget` slots by current survival, admitted on the
        device, and the verify layout: admitted drafts into `_admitted`,
        offsets into `query_start_loc`; returns cu_num_logits [n + 1]."""
        n = idx_mapping.shape[0]
        admitted = self._admitted[:n]
        # Static shape (all R slots; rows past n drafted nothing), so the
        # compiled selector never recompiles. Position-major ranking is
        # unchanged by the padding rows.
        drafted = self._drafted
        drafted.zero_()
        host_to_device(drafts, out=drafted[:n])
        conf = self._conf_rows
        conf.fill_(1.0)
        conf[:n] = self._conf.index_select(0, idx_mapping.long())
        admitted.copy_(self._select(survival(conf), drafted, budget)[:n])
        own = host_to_device(non_draft, out=self._non_draft[:n])
        # Logits: each request's admitted drafts plus its bonus token; tokens:
        # its admitted drafts plus its own; unused request rows end at the total.
        logits = self._prefix_sums(admitted + self.num_bonus_tokens, self._cu_num_logits)
        self._prefix_sums(admitted + own, query_start_loc)
        query_start_loc[n + 1 :].fill_(num_tokens)
        return logits

    def _send_layout(self, admitted: np.ndarray, non_draft: np.ndarray, num_tokens: int) -> None:
        """Admitted drafts, cu_num_logits and query_start_loc of a layout
        decided on the host: filled in `_layout_host`, one copy to the
        device, one into query_start_loc. Entries past the batch: no
        drafts, offsets ending at the totals."""
        n, R, L = admitted.size, self.R, self.query_start_loc.numel()
        host = self._layout_host
        host[:R] = 0
        host[:n] = admitted
        logits = _host_offsets(admitted + self.num_bonus_tokens)
        host[R : R + L] = logits[-1]
        host[R : R + n + 1] = logits
        host[R + L :] = num_tokens
        host[R + L : R + L + n + 1] = _host_offsets(admitted + non_draft)
        host_to_device(host, out=self._layout)
        self.query_start_loc.copy_(self._staged_query_start_loc)

    # ------------------------------------------------------------- metrics
    def _maybe_write_metrics(self) -> None:
        # Ticked by budgeted steps and by depth choices: a run of depth-0
        # steps budgets nothing and must still show up.
        self._ticks += 1
        o = self.options
        if not o.metrics_dir or self._ticks % o.metrics_interval:
            return
        from vllm_av.vllm.metrics import write_snapshot

        extra = ({"catch_up_tokens": positions_caught_up(),
                  "catch_up_holes_left": positions_left_as_holes()}
                 if o.drafter_catch_up else None)
        # Served (interval > 1): the file is written beside the engine's thread.
        write_snapshot(o.metrics_dir, self._snapshot_view(), rank=self.rank, extra=extra,
                       background=o.metrics_interval > 1)

    def _snapshot_view(self):
        """The fields vllm_av.vllm.metrics.snapshot reads, from host numbers
        only (no sync): coefficients and accepted counts are one step old."""
        s, K = self.stats, self.num_speculative_steps
        coef = s.coefficients or [float("nan")] * (K + 1)
        stats = SimpleNamespace(
            num_steps=s.num_steps, drafted=s.drafted, verified=s.verified,
            admitted=s.admitted, accepted=s.accepted, trimmed=s.trimmed,
            last_budget=s.last_budget, last_depth=K if s.last_depth < 0 else s.last_depth,
            depth_steps=s.depth_steps, zero_depth_steps=s.zero_depth_steps,
            depth_counts=s.depth_counts, predicted=np.zeros(K), observed=np.zeros(K), labelled=np.zeros(K),
            confidence_source=s.confidence_source,
        )
        est = SimpleNamespace(slope=coef[0], intercepts=coef[1:])
        return SimpleNamespace(stats=stats, estimator=est)
