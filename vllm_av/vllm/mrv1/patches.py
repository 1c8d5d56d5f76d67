"""Model Runner V1 patches: score drafts, trim them, learn from outcomes.

Flow on the V1 runner with synchronous scheduling (the CPU backend always
schedules synchronously in vLLM 0.32):

  step t  : target forward + rejection sampling; with adaptive depth,
            `AdaptiveVerifier.choose_depth` picks the drafting depth d <= K
            from stale scores; the drafter proposes d tokens per request
            and, through our proposer patch, we record a lossless feature
            per draft slot.
            -> `AdaptiveVerifier.admit` sizes the budget from one-step-old
            scores and admits a prefix of each draft; the drafts handed to
            the scheduler are cut to that prefix, so trimmed drafts never get
            a KV slot and never reach the target.
  step t+1: the admitted drafts are verified; in bookkeeping we read how many
            were accepted and feed the estimator.

All AV state lives on the runner instance in the worker process (it never
crosses a process boundary); what must reach the workers (our options) is in
`VllmConfig.additional_config`.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from vllm_av.core.features import FEATURE_CLIP, draft_features, match_length_feature
from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.metrics import write_snapshot
from vllm_av.vllm.mrv1.async_timing import TIMING_INTERVAL, AsyncStepClock, answer, timing_due
from vllm_av.vllm.mrv1.cpu_async import CPUAsyncForTestsPatch
from vllm_av.vllm.mrv1.draft_layer_metadata import DraftLayerMetadataPatch
from vllm_av.vllm.mrv1.drafter_catch_up import catch_up_of, step_rows
from vllm_av.vllm.mrv1.graphs import VarlenFullGraphsPatch
from vllm_av.vllm.mrv1.lossless_fix import LOSSLESS_PATCHES
from vllm_av.vllm.mrv1.plain_step import PlainZeroDraftStepPatch, runs_plain, schedules_no_draft
from vllm_av.vllm.mrv1.scheduled_depth import ScheduledDepthPatch, register_local_verifier
from vllm_av.vllm.mrv1.startup import build_verifier, drafter_depth, sync_device
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")

_AV_ATTR = "_vllm_av_verifier"
_OPTIONS_ATTR = "_vllm_av_options"
_FEATURES_ATTR = "_vllm_av_features"
# Negative-control only (AVOptions.test_lossy_admission): per slot, whether
# the drafted token is the draft's top token.
_TOP_ATTR = "_vllm_av_top"
_PROPOSE_STEPS_ATTR = "_vllm_av_propose_steps"


def verifier_of(runner):
    return getattr(runner, _AV_ATTR, None)


def features_from_probs(probs: torch.Tensor) -> torch.Tensor:
    """logit(q_max) from a probability vector [..., V] -> [...].

    1 - q_max is taken as the sum of the other probabilities, not as
    1 - q_max, so it does not round to 0 when q_max is close to 1.
    """
    q = probs.float()
    q_max = q.max(dim=-1).values
    rest = (q.sum(dim=-1) - q_max).clamp_min(1e-30)
    return (q_max.clamp_min(1e-30).log() - rest.log()).clamp(-FEATURE_CLIP, FEATURE_CLIP)


class DraftFeaturePatch(VllmPatch):
    """Record a lossless feature of each draft distribution while drafting.

    Target: vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._sample_draft_tokens
    Why: the confidence of a draft slot comes from the draft distribution
        q_i, which vLLM computes and throws away (greedy drafting keeps only
        the argmax).
    How: while our runner patch has armed the proposer (a list on the
        instance), compute logit(q_max) from the logits (greedy drafting:
        one lm_head pass, as vLLM does, then argmax) or from the draft
        probabilities (probabilistic drafting) and append it. The feature
        never looks at the sampled token (DESIGN 2.5).
    Upstream: a drafter hook that exposes per-slot draft logits or scores.
    Remove when: vLLM's V1 drafters return draft confidences.
    vLLM: 0.32.0
    """

    target = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
    attributes = ("_sample_draft_tokens",)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        record = getattr(self, _FEATURES_ATTR, None)
        orig = type(self)._orig__sample_draft_tokens
        if record is None:
            return orig(self, hidden_states, sampling_metadata)
        greedy = (
            not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy
        )
        if greedy and not self.use_local_argmax_reduction and not self.use_heterogeneous_vocab:
            logits = self.model.compute_logits(hidden_states)
            record.append(draft_features(logits, 1.0))
            return logits.argmax(dim=-1), None
        tokens, probs = orig(self, hidden_states, sampling_metadata)
        if probs is not None:
            record.append(features_from_probs(probs))
            top = getattr(self, _TOP_ATTR, None)
            if top is not None:
                top.append(tokens.view(-1) == probs.argmax(dim=-1).view(-1))
        else:
            record.append(torch.zeros(tokens.shape[0], device=tokens.device))
        return tokens, probs


class RunnerAdmitPatch(VllmPatch):
    """Choose the drafting depth, then admit a prefix of each draft before
    it is scheduled.

    Target: vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids
    Why: vLLM 0.32's V1 runner drafts K tokens per request and verifies
        every draft; past the knee of the step-cost curve the deep, mostly
        rejected slots cost more than they return, and with a draft model
        the K drafter forwards alone can make speculation slower than none.
    How: with adaptive depth (option `adaptive_depth`), pick d with
        `AdaptiveVerifier.choose_depth` (stale scores only) and call the
        original with `scheduler_output.num_spec_tokens_to_schedule = d`
        (vLLM's drafters take num_speculative_tokens from it), and the
        drafter's own `num_speculative_tokens` set to d (suffix decoding
        reads that), both restored afterwards. At d = 0 the drafter is not
        called at all (option `zero_depth_skips_drafter`; off, an LLM
        drafter runs only its KV-sync forward and returns [R, 0]; with
        option `drafter_catch_up`, a later drafting step first runs the
        draft model over the positions it missed, drafter_catch_up.py).
        Arm the proposer's feature
        recording, then run `AdaptiveVerifier.admit` and return the drafts
        cut to the admitted prefix as lists (the form the V1 runner already
        hands to the scheduler for CPU-side drafters), so trimmed drafts
        take no KV slot and no target compute. Every 4th drafting call is
        timed and corrects the profiled drafting table
        (`AdaptiveVerifier.observe_draft_time`); every 4th step, the time
        from its start (RunnerForgetPatch) to drafting corrects the
        verification table (`AdaptiveVerifier.observe_verify_time`).
    Upstream: an admission hook between drafting and scheduling in V1
        (vLLM's dynamic speculative decoding already sets the depth through
        num_spec_tokens_to_schedule, from a static lookup table).
    Remove when: vLLM's V1 runner supports adaptive verification.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    attributes = ("propose_draft_token_ids",)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        orig = type(self)._orig_propose_draft_token_ids
        verifier = verifier_of(self)
        if verifier is None:
            return orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        options = getattr(self, _OPTIONS_ATTR, None)
        if options is not None and options.scheduled_depth:
            return _propose_scheduled(self, verifier, orig, scheduler_output,
                                      sampled_token_ids, *args, **kwargs)
        _StepTimer.stop(self, verifier)
        drafter = self.drafter
        calibrate = options is None or options.calibrate_costs
        depth = None
        if options is not None and options.adaptive_depth:
            # No exploration over prompt tokens: the drafter would run over
            # them all at full depth (see AdaptiveVerifier.choose_depth).
            depth = _choose_depth(self, verifier, may_explore=not carries_prefill(scheduler_output))
        arm = hasattr(drafter, "_sample_draft_tokens")
        lossy = options is not None and options.test_lossy_admission
        if arm:
            setattr(drafter, _FEATURES_ATTR, [])
            setattr(drafter, _TOP_ATTR, [] if lossy else None)
        catch_up = catch_up_of(self, options)
        if depth == 0 and options.zero_depth_skips_drafter:
            # Plain decoding this step: no drafter call at all (vLLM's own
            # path when a drafter's input does not fit). With synchronous
            # scheduling, which our config enforces on V1, nothing else in
            # the runner waits on the drafter's outputs.
            if catch_up is not None:
                _note_skipped(self, catch_up, scheduler_output)
            self._draft_probs = None
            self._draft_prob_req_ids = None
            out = [[] for _ in range(self.input_batch.num_reqs)]
            _maybe_write_metrics(self, verifier)
            return out
        if catch_up is not None:
            _catch_up_before_drafting(self, catch_up, scheduler_output)
        timer = _DraftTimer(self, calibrate)
        with _drafting_depth(scheduler_output, drafter, depth):
            try:
                with timer:
                    drafts = orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
                recorded = getattr(drafter, _FEATURES_ATTR, None) if arm else None
                top = getattr(drafter, _TOP_ATTR, None) if arm else None
            finally:
                if arm:
                    setattr(drafter, _FEATURES_ATTR, None)
                    setattr(drafter, _TOP_ATTR, None)
        if timer.ms is not None:
            num_drafting = _num_decoding(self)
            verifier.observe_draft_time(
                verifier.K if depth is None else depth, num_drafting, timer.ms
            )
        out = _admit(self, verifier, drafts, recorded, top if lossy else None)
        _maybe_write_metrics(self, verifier)
        return out


def _note_skipped(runner, catch_up, scheduler_output) -> None:
    """Option drafter_catch_up: a step that skipped the drafter. Its rows
    are listed only when needed (not on every step of a depth-0 stretch
    under synchronous scheduling)."""
    if catch_up.skip_needs_rows:
        catch_up.skipped(step_rows(runner, scheduler_output), runner)


def _catch_up_before_drafting(runner, catch_up, scheduler_output) -> None:
    """Option drafter_catch_up: write the draft KV the drafter missed while
    skipped, then note that it runs over this step's tokens."""
    rows = step_rows(runner, scheduler_output)
    holes = catch_up.holes(rows)
    if holes:
        catch_up.catch_up(runner, holes)
    catch_up.drafted(rows)


def _propose_scheduled(runner, verifier, orig, scheduler_output, sampled_token_ids,
                       *args, **kwargs):
    """Scheduled depth (async scheduling): the scheduler chose this step's
    depth (`num_spec_tokens_to_schedule`) and reserved its slots, so vLLM
    drafts exactly that and every draft is verified. At depth 0 the drafter
    is skipped (`zero_depth_skips_drafter`, as in the synchronous path);
    off, vLLM's drafter runs the forward that keeps its KV cache whole. We
    record the drafts' features for the estimator and hand vLLM's drafts
    back as they are. No synchronizing timers, which would stall the
    async pipeline: timings come from device events read later
    (async_timing.py)."""
    options = getattr(runner, _OPTIONS_ATTR, None)
    depth = scheduler_output.num_spec_tokens_to_schedule
    clock = _async_clock(runner)
    timed = clock is not None and clock.timing
    if timed:
        clock.drafting_starts()
    catch_up = catch_up_of(runner, options)
    if depth == 0 and options is not None and options.zero_depth_skips_drafter:
        plain = options.async_plain_steps and schedules_no_draft(scheduler_output)
        out = _skip_drafter_async(runner, sampled_token_ids, copy_counts=not plain)
        if catch_up is not None:
            _note_skipped(runner, catch_up, scheduler_output)
    else:
        if catch_up is not None:
            _catch_up_before_drafting(runner, catch_up, scheduler_output)
        out = _draft_scheduled(runner, verifier, orig, scheduler_output,
                               sampled_token_ids, *args, **kwargs)
    if timed:
        clock.drafting_done(depth, _num_decoding(runner))
    if clock is not None:
        clock.collect(verifier)
    _maybe_write_metrics(runner, verifier)
    return out


def _draft_scheduled(runner, verifier, orig, scheduler_output, sampled_token_ids,
                     *args, **kwargs):
    """vLLM drafts the scheduled depth; we record the drafts' features and
    mark them all admitted (the estimator learns from every one)."""
    drafter = runner.drafter
    arm = hasattr(drafter, "_sample_draft_tokens")
    if arm:
        setattr(drafter, _FEATURES_ATTR, [])
        setattr(drafter, _TOP_ATTR, None)
    try:
        drafts = orig(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
        recorded = getattr(drafter, _FEATURES_ATTR, None) if arm else None
    finally:
        if arm:
            setattr(drafter, _FEATURES_ATTR, None)
    if torch.is_tensor(drafts) and drafts.shape[-1] > 0:
        num_reqs = runner.input_batch.num_reqs
        discard = runner.discard_request_mask.np[:num_reqs]
        num_drafted = np.where(discard, 0, drafts.shape[1]).astype(np.int64)
        if num_drafted.sum() > 0:
            n = int((num_drafted > 0).sum())
            verifier.admit(
                list(runner.input_batch.req_ids),
                _features(recorded, num_reqs, num_drafted, verifier.K),
                num_drafted, num_sampling=n, num_other_tokens=n, admit_all=True,
            )
    return drafts


def _skip_drafter_async(runner, sampled_token_ids, copy_counts: bool = True):
    """A depth-0 step under async scheduling without the drafter: what
    vLLM's runner does when a drafter's input does not fit. The next step's
    input preparation still reads how many of this step's sampled tokens
    are valid, so that count is copied as vLLM's drafting path would.
    `copy_counts=False` (a step that verified no draft): every valid count
    is 1 and nothing is left to correct, so vLLM's runner takes its plain
    path next step (the sampled tokens stay its next input, set by its
    bookkeeping)."""
    drafter = runner.drafter
    prepare = getattr(drafter, "prepare_next_token_ids_padded", None)
    if (copy_counts and prepare is not None and torch.is_tensor(sampled_token_ids)
            and getattr(runner, "valid_sampled_token_count_event", None) is not None):
        next_token_ids, valid_counts = prepare(
            sampled_token_ids, runner.requests, runner.input_batch,
            runner.discard_request_mask.gpu,
        )
        runner._copy_valid_sampled_token_count(next_token_ids, valid_counts)
    num_reqs = runner.input_batch.num_reqs
    if torch.is_tensor(sampled_token_ids):
        return torch.empty(num_reqs, 0, device=sampled_token_ids.device, dtype=torch.int64)
    return [[] for _ in range(num_reqs)]


# Time a step of a kind (drafting, a plain step, a speculative step) with a
# device synchronize on each side on CUDA, this many steps after the last
# timed one of that kind (`timing_due`), to correct the cost tables
# (AdaptiveVerifier.observe_draft_time, observe_verify_time).
DRAFT_TIMING_INTERVAL = TIMING_INTERVAL
_LAST_TIMED_ATTR = "_vllm_av_last_timed"  # kind -> the step last timed


def _last_timed(runner) -> dict:
    last = getattr(runner, _LAST_TIMED_ATTR, None)
    if last is None:
        last = {}
        setattr(runner, _LAST_TIMED_ATTR, last)
    return last


class _DraftTimer:
    """Wall time of one drafting call (see `timing_due`)."""

    def __init__(self, runner, enabled: bool = True):
        step = getattr(runner, _STEP_CALLS_ATTR, 0)
        self.active = enabled and timing_due(_last_timed(runner), "draft", step)
        self.runner = runner
        self.ms = None

    def __enter__(self):
        if self.active:
            sync_device(getattr(self.runner, "device", None))
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.active and exc_type is None:
            sync_device(getattr(self.runner, "device", None))
            self.ms = (time.perf_counter() - self.t0) * 1e3
        return False


class _StepTimer:
    """Wall time of a step up to drafting (input preparation, the target
    forward, sampling and verification), plain steps and speculative ones
    paced apart (`timing_due`), for `AdaptiveVerifier.observe_verify_time`."""

    ATTR = "_vllm_av_step_timer"

    @classmethod
    def start(cls, runner, num_tokens: int, plain: bool = False, prefill=False) -> None:
        """`prefill`: as for AsyncStepClock.step_started."""
        n = getattr(runner, _STEP_CALLS_ATTR, 0) + 1
        setattr(runner, _STEP_CALLS_ATTR, n)
        mark = None
        if num_tokens > 0 and timing_due(_last_timed(runner), ("step", plain), n):
            sync_device(getattr(runner, "device", None))
            mark = (time.perf_counter(), int(num_tokens), plain, answer(prefill))
        setattr(runner, cls.ATTR, mark)

    @classmethod
    def stop(cls, runner, verifier) -> None:
        mark = getattr(runner, cls.ATTR, None)
        if mark is None:
            return
        setattr(runner, cls.ATTR, None)
        sync_device(getattr(runner, "device", None))
        t0, num_tokens, plain, prefill = mark
        verifier.observe_verify_time(num_tokens, (time.perf_counter() - t0) * 1e3, plain=plain,
                                     prefill=prefill)


def carries_prefill(scheduler_output) -> bool:
    """Whether a step schedules prompt tokens: more tokens than one per
    request plus its drafts (a new request, or a chunk of a long prompt)."""
    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    decode_tokens = len(scheduler_output.num_scheduled_tokens) + sum(map(len, spec.values()))
    return scheduler_output.total_num_scheduled_tokens > decode_tokens


_STEP_CALLS_ATTR = "_vllm_av_step_calls"


def _num_decoding(runner) -> int:
    num_reqs = runner.input_batch.num_reqs
    return int(num_reqs - runner.discard_request_mask.np[:num_reqs].sum())


def _choose_depth(runner, verifier, may_explore: bool = True) -> int:
    """The drafting depth of this step, from stale scores and counts only."""
    num_reqs = runner.input_batch.num_reqs
    req_ids = runner.input_batch.req_ids[:num_reqs]
    # Requests still in (chunked) prefill draft nothing the scheduler keeps.
    discard = runner.discard_request_mask.np[:num_reqs]
    decoding = [rid for rid, d in zip(req_ids, discard) if not d]
    n = len(decoding)
    # A request with its own seed is verified in full, so that its output
    # depends on its seed alone (see `_admit`); it must be drafted in full too.
    seeded = any(idx < num_reqs for idx in runner.input_batch.generators)
    return verifier.choose_depth(
        decoding, num_sampling=n, num_other_tokens=n, min_depth=verifier.K if seeded else 0,
        may_explore=may_explore,
    )


@contextlib.contextmanager
def _drafting_depth(scheduler_output, drafter, depth: int | None):
    """Draft `depth` tokens in this call (None: vLLM's own depth)."""
    if depth is None:
        yield
        return
    saved = scheduler_output.num_spec_tokens_to_schedule
    scheduler_output.num_spec_tokens_to_schedule = depth
    try:
        with drafter_depth(drafter, depth):
            yield
    finally:
        scheduler_output.num_spec_tokens_to_schedule = saved


def _admit(runner, verifier, drafts, recorded, lossy_top=None):
    req_ids = list(runner.input_batch.req_ids)
    num_reqs = len(req_ids)
    K = verifier.K
    on_device = torch.is_tensor(drafts)
    if on_device:
        # A request still in (chunked) prefill drafts nothing the scheduler
        # will keep: vLLM discards its sampled token and its drafts.
        discard = runner.discard_request_mask.np[:num_reqs]
        num_drafted = np.where(discard, 0, drafts.shape[1]).astype(np.int64)
        rows = None  # the token ids come over with the admission (one transfer)
    else:
        rows = [list(r) for r in drafts]
        num_drafted = np.array([len(r) for r in rows], dtype=np.int64)
    num_drafted = np.minimum(num_drafted, K)
    if num_drafted.sum() == 0:
        return [[] for _ in range(num_reqs)]

    features = _features(recorded, num_reqs, num_drafted, K)
    num_decoding = int((num_drafted > 0).sum())
    admitted, fetched = verifier.admit_fetching(
        req_ids,
        features,
        num_drafted,
        # Next step: every decoding request samples, and contributes one
        # non-draft token (the one it sampled this step).
        num_sampling=num_decoding,
        num_other_tokens=num_decoding,
        fetch=drafts[:num_reqs] if on_device else None,
    )
    if on_device:
        rows = fetched.tolist()
    # A request with its own seed is verified in full, so that its output
    # depends on its seed alone (as without AV), not on how much of its
    # draft the load of the moment let through. The override is fixed per
    # request, so it keeps the admission independent of the drafted tokens.
    for idx in runner.input_batch.generators:
        if idx < num_reqs:
            admitted[idx] = num_drafted[idx]
    if lossy_top:
        admitted = _lossy_cut(admitted, lossy_top, num_reqs)
    return [r[: int(a)] for r, a in zip(rows, admitted)]


def _lossy_cut(admitted: np.ndarray, top: list, num_reqs: int) -> np.ndarray:
    """NEGATIVE CONTROL, never on in service: cut each draft before its first
    token that is not the draft's top token. The rule looks at the drafted
    token itself, which DESIGN 2.5 forbids; the distribution tests must
    catch it (tests/vllm/test_lossless_cpu.py)."""
    is_top = torch.stack([t[:num_reqs] for t in top], dim=1).cpu().numpy()  # [R, d]
    first_miss = np.where(is_top.all(1), is_top.shape[1], (~is_top).argmax(1))
    return np.minimum(admitted, first_miss)


def _features(recorded, num_reqs, num_drafted, K) -> torch.Tensor:
    """[num_reqs, K] features; model-free drafters get their own."""
    if recorded and len(recorded) >= 1 and recorded[0].shape[0] >= num_reqs:
        cols = [f[:num_reqs].float() for f in recorded[:K]]
        feats = torch.stack(cols, dim=1)
        if feats.shape[1] < K:
            pad = torch.zeros(num_reqs, K - feats.shape[1], device=feats.device)
            feats = torch.cat([feats, pad], dim=1)
        return feats
    # ngram / suffix: the proposal length is how far the matched
    # continuation reaches, a property of the context, not of any token.
    return match_length_feature(torch.as_tensor(num_drafted)).unsqueeze(1).expand(
        num_reqs, K
    ).contiguous()


def _learnable(runner, scheduler_output, req_ids) -> np.ndarray:
    """False for requests whose target distribution was changed by
    sampling transforms the drafter did not see."""
    b = runner.input_batch
    transformed = (
        b.frequency_penalties_reqs
        | b.presence_penalties_reqs
        | b.repetition_penalties_reqs
        | b.has_allowed_token_ids
    )
    bad_words_idx = set(b.bad_words_token_ids)
    requests = getattr(runner, "requests", None) or {}
    return np.array(
        [rid not in transformed and i not in bad_words_idx
         and not _params_change_target(requests.get(rid))
         for i, rid in enumerate(req_ids)],
        dtype=bool,
    )


def _params_change_target(request_state) -> bool:
    """Whether the request's own sampling parameters change the target's
    logits in ways the drafter does not see: a grammar (structured output;
    vLLM 0.32's SchedulerOutput carries no ids of such requests, they travel
    in the GrammarOutput handed to `sample_tokens`), a logit bias, or a
    minimum length (end tokens masked until it is reached)."""
    params = getattr(request_state, "sampling_params", None)
    if params is None:
        return False
    return (
        getattr(params, "structured_outputs", None) is not None
        or bool(getattr(params, "logit_bias", None))
        or (getattr(params, "min_tokens", 0) or 0) > 0
    )


class RunnerObservePatch(VllmPatch):
    """Feed accept/reject outcomes of admitted drafts to the estimator.

    Target: vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync
    Why: the online estimator learns from the verification outcomes, which
        vLLM computes but does not expose per request.
    How: after the original bookkeeping, read per request the number of
        drafts that were scheduled (verified) and the number of valid
        sampled tokens (accepted + 1), and call `AdaptiveVerifier.observe`.
    Upstream: per-request acceptance counts in the runner output.
    Remove when: vLLM's V1 runner supports adaptive verification.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    attributes = ("_bookkeeping_sync",)

    def _bookkeeping_sync(self, scheduler_output, *args, **kwargs):
        out = type(self)._orig__bookkeeping_sync(self, scheduler_output, *args, **kwargs)
        verifier = verifier_of(self)
        spec = scheduler_output.scheduled_spec_decode_tokens
        # Under async scheduling the outcomes are not on the host yet: they
        # are observed a step later (RunnerForgetPatch).
        if verifier is not None and spec and not getattr(self, "use_async_scheduling", False):
            valid_sampled = out[3]
            req_ids = list(self.input_batch.req_ids)
            num_verified = np.array([len(spec.get(r, ())) for r in req_ids])
            num_accepted = np.array(
                [max(len(valid_sampled[i]) - 1, 0) for i in range(len(req_ids))]
            )
            verifier.observe(
                req_ids,
                num_verified,
                num_accepted,
                learn=_learnable(self, scheduler_output, req_ids),
            )
            _maybe_write_metrics(self, verifier, count_step=False)
        return out


def _maybe_write_metrics(runner, verifier, count_step: bool = True) -> None:
    """Write the snapshot every `metrics_interval` drafting steps (zero-depth
    ones included), after drafting and again after the bookkeeping of the
    same step (model drafters draft first), so it lags by no step."""
    options = getattr(runner, _OPTIONS_ATTR, None)
    if options is None or not options.metrics_dir:
        return
    steps = getattr(runner, _PROPOSE_STEPS_ATTR, 0) + int(count_step)
    setattr(runner, _PROPOSE_STEPS_ATTR, steps)
    if steps and steps % options.metrics_interval == 0:
        catch_up = catch_up_of(runner, options)
        extra = {"catch_up_tokens": catch_up.tokens_total} if catch_up is not None else None
        # Served (interval > 1): the file is written beside the engine's thread.
        write_snapshot(options.metrics_dir, verifier, rank=getattr(runner, "rank", 0) or 0,
                       extra=extra, background=options.metrics_interval > 1)


class RunnerForgetPatch(VllmPatch):
    """Drop AV state of finished and preempted requests; mark the start of
    a step.

    Target: vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states
    Why: the verifier keeps per-request rows (stale scores, pending
        features); without this they would outlive their requests. And
        the verifier must know which admitted drafts this step verifies:
        with model drafters the runner drafts the next step before it
        books this step's outcomes.
    How: forget the finished and preempted request ids and, when the step
        schedules any token, `AdaptiveVerifier.begin_step` (and, every 4th
        step, start the step timer RunnerAdmitPatch stops; with option
        `drafter_catch_up`, note new and resumed requests' first
        positions, in both schedulings); then call the original.
    Upstream: none needed if AV state lived in vLLM's request state.
    Remove when: vLLM's V1 runner supports adaptive verification.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
    attributes = ("_update_states",)

    def _update_states(self, scheduler_output):
        verifier = verifier_of(self)
        orig = type(self)._orig__update_states
        if verifier is None:
            return orig(self, scheduler_output)
        if getattr(self, "use_async_scheduling", False):
            return _update_states_async(self, verifier, orig, scheduler_output)
        verifier.forget(scheduler_output.finished_req_ids)
        verifier.forget(scheduler_output.preempted_req_ids or ())
        if scheduler_output.total_num_scheduled_tokens > 0:
            verifier.begin_step()
        options = getattr(self, _OPTIONS_ATTR, None)
        catch_up = catch_up_of(self, options)
        if catch_up is not None:
            catch_up.begin_step(scheduler_output)
        if options is None or options.calibrate_costs:
            _StepTimer.start(self, scheduler_output.total_num_scheduled_tokens,
                             plain=runs_plain(self, scheduler_output),
                             prefill=lambda: carries_prefill(scheduler_output))
        return orig(self, scheduler_output)


_PENDING_OBSERVE_ATTR = "_vllm_av_pending_observe"
_PREV_SPEC_ATTR = "_vllm_av_prev_spec"
_ASYNC_CLOCK_ATTR = "_vllm_av_async_clock"


def _async_clock(runner):
    """The runner's AsyncStepClock when costs are calibrated, else None."""
    options = getattr(runner, _OPTIONS_ATTR, None)
    if options is not None and not options.calibrate_costs:
        return None
    clock = getattr(runner, _ASYNC_CLOCK_ATTR, None)
    if clock is None:
        clock = AsyncStepClock(getattr(runner, "device", None))
        setattr(runner, _ASYNC_CLOCK_ATTR, clock)
    return clock


def _update_states_async(runner, verifier, orig, scheduler_output):
    """Async scheduling: the outcomes of the previous step reach the host
    only in the correction closure vLLM's `_update_states` returns (run once
    this step's forward is launched). Observe them there, then mark this
    step's verified drafts (`begin_step`), before this step drafts."""
    clock = _async_clock(runner)
    if clock is not None:
        clock.step_started(scheduler_output.total_num_scheduled_tokens,
                           plain=runs_plain(runner, scheduler_output),
                           prefill=lambda: carries_prefill(scheduler_output))
    pending = getattr(runner, _PENDING_OBSERVE_ATTR, None)
    if pending is not None:
        # vLLM never ran last step's closure (a step that launched nothing):
        # our part still runs, without its outcomes (they were not copied).
        pending(observe=False)
    prev = getattr(runner, _PREV_SPEC_ATTR, None) or {}
    setattr(runner, _PREV_SPEC_ATTR, {
        rid: len(toks) for rid, toks in scheduler_output.scheduled_spec_decode_tokens.items()
    })
    gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
    catch_up = catch_up_of(runner, getattr(runner, _OPTIONS_ATTR, None))
    if catch_up is not None:
        catch_up.begin_step(scheduler_output)
    correction = orig(runner, scheduler_output)
    stepping = scheduler_output.total_num_scheduled_tokens > 0

    def ours(observe: bool = True):
        setattr(runner, _PENDING_OBSERVE_ATTR, None)
        if observe:
            _observe_previous(runner, verifier, scheduler_output, prev, gone)
        verifier.forget(gone)
        if stepping:
            verifier.begin_step()

    if correction is None:
        ours()
        return None
    setattr(runner, _PENDING_OBSERVE_ATTR, ours)

    def correction_then_ours():
        correction()
        ours()

    return correction_then_ours


def _observe_previous(runner, verifier, scheduler_output, prev: dict, gone: set) -> None:
    """Accepted counts of the previous step's verified drafts (vLLM's own
    valid-sampled counts, already on the host once its correction ran)."""
    if not any(prev.values()):
        return
    counts = runner._get_valid_sampled_token_count()
    index = runner.input_batch.prev_req_id_to_index or {}
    rows = [(rid, n, index.get(rid)) for rid, n in prev.items() if n > 0]
    rows = [(rid, n, i) for rid, n, i in rows if i is not None and i < len(counts)]
    if not rows:
        return
    req_ids = [rid for rid, _, _ in rows]
    num_verified = np.array([n for _, n, _ in rows])
    num_accepted = np.array([max(min(counts[i] - 1, n), 0) for _, n, i in rows])
    now = runner.input_batch.req_id_to_index
    learnable = _learnable(runner, scheduler_output, list(runner.input_batch.req_ids))
    learn = np.array([rid not in gone and rid in now and bool(learnable[now[rid]])
                      for rid in req_ids], dtype=bool)
    verifier.observe(req_ids, num_verified, num_accepted, learn=learn)


def _attach_verifier(worker) -> None:
    options = av_options_of(worker.vllm_config)
    runner = worker.model_runner
    # Model Runner V2 (vllm.v1.worker.gpu.*) carries our options too, but
    # there our estimator and manager sit inside vLLM's own AV (mrv2/).
    if type(runner).__module__.startswith("vllm.v1.worker.gpu."):
        return
    if options is not None:
        setattr(runner, _OPTIONS_ATTR, options)
        verifier = build_verifier(runner, options)
        setattr(runner, _AV_ATTR, verifier)
        # For the scheduler of this process (scheduled depth, async
        # scheduling); only then, or nothing would claim it here.
        if options.scheduled_depth:
            register_local_verifier(verifier)


class CPUWorkerStartupPatch(VllmPatch):
    """Profile step costs and build our verifier once the CPU worker is warm.

    Target: vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model
    Why: the budget needs step costs of this model on this machine, which
        can only be measured once the KV cache exists and the model is warm.
    How: after the original warm-up, time dummy target steps and drafter
        steps (eager on the CPU), build the cost model and attach an
        `AdaptiveVerifier` to the runner; log a one-line summary.
    Upstream: a post-warm-up hook for platform plugins.
    Remove when: vLLM offers such a hook.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.cpu_worker:CPUWorker"
    attributes = ("compile_or_warm_up_model",)
    # Importing vllm.v1.worker.cpu_worker replaces torch.cuda streams and
    # events with CPU stand-ins: never import it on a GPU machine.
    platforms = ("cpu",)

    def compile_or_warm_up_model(self):
        out = type(self)._orig_compile_or_warm_up_model(self)
        _attach_verifier(self)
        return out


class GPUWorkerStartupPatch(VllmPatch):
    """Profile step costs and build our verifier once the GPU worker has
    captured its CUDA graphs (Model Runner V1 on GPU).

    Target: vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model
    Why: as for the CPU worker: costs must be measured on the warm model,
        here with the captured graphs, so that the cost table is the
        staircase the real steps pay.
    How: after the original (compile, graph capture), time target-only
        dummy steps at every capture size and a few above, with attention
        over a synthetic context, and drafter steps; attach the verifier.
    Upstream: a post-warm-up hook for platform plugins.
    Remove when: vLLM offers such a hook.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_worker:Worker"
    attributes = ("compile_or_warm_up_model",)
    platforms = ("cuda",)

    def compile_or_warm_up_model(self):
        out = type(self)._orig_compile_or_warm_up_model(self)
        _attach_verifier(self)
        return out


MRV1_PATCHES = [
    # Sampling fixes that make speculative decoding lossless on the CPU backend.
    *LOSSLESS_PATCHES,
    # Adaptive verification.
    DraftFeaturePatch,
    RunnerAdmitPatch,
    RunnerObservePatch,
    RunnerForgetPatch,
    PlainZeroDraftStepPatch,
    DraftLayerMetadataPatch,
    CPUWorkerStartupPatch,
    GPUWorkerStartupPatch,
    VarlenFullGraphsPatch,
    # Async scheduling: the depth is chosen when the step is scheduled.
    ScheduledDepthPatch,
    CPUAsyncForTestsPatch,
]
