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

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_av.core.budget import best_depth, size_budget
from vllm_av.core.cost_model import CostModel
from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.selector import select_admitted
from vllm_av.core.stale_rows import StaleRowCalibration
from vllm_av.core.survival import survival
from vllm_av.core.transfer import host_to_device


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
    # Steps at each depth 0..K (what /metrics shows per depth).
    depth_counts: list = field(default_factory=list)
    # Per position: sum of predicted conditional acceptance and of observed
    # labels over labelled slots, and the label count (calibration).
    predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))
    observed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    labelled: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # The slope of the map from stale rows to the next drafts' acceptance
    # (stale_rows.py; 1 with zero intercepts: the rows as they are).
    stale_row_slope: float = 1.0


def record_depth(stats, depth: int, K: int) -> None:
    """One more step at `depth` in a stats object's depth counters
    (last_depth, depth_steps, zero_depth_steps and the per-depth tally of
    K + 1 entries): the verifier's and the MRV2 manager's alike."""
    stats.last_depth = depth
    stats.depth_steps += 1
    stats.zero_depth_steps += int(depth == 0)
    counts = stats.depth_counts
    if len(counts) < K + 1:
        counts.extend([0] * (K + 1 - len(counts)))
    counts[depth] += 1


def _fetch_together(admitted: torch.Tensor, stacked: torch.Tensor,
                    fetch: torch.Tensor | None):
    """admitted [R], stacked [2, R, k] (survival, confidence) and `fetch` on
    the host in one transfer (on CUDA each .cpu() waits for the device).
    float64 holds int32 counts, float32 scores and integers below 2**53
    exactly. Returns admitted (int64), survival and confidence (float32,
    [R, k] each) and fetch (int64, its shape; None without it)."""
    if fetch is not None and (fetch.dtype.is_floating_point or fetch.dtype.is_complex):
        raise TypeError(f"fetch must be an integer tensor, got {fetch.dtype}")
    parts = [admitted.reshape(-1), stacked.reshape(-1)]
    if fetch is not None:
        parts.append(fetch.reshape(-1).to(stacked.device))
    host = torch.cat([p.double() for p in parts]).cpu().numpy()
    R, n = admitted.numel(), stacked.numel()
    surv_np, conf_np = host[R:R + n].astype(np.float32).reshape(stacked.shape)
    fetched = None
    if fetch is not None:
        fetched = host[R + n:].astype(np.int64).reshape(tuple(fetch.shape))
    return host[:R].astype(np.int64), surv_np, conf_np, fetched


class _Drafts:
    """Admitted drafts awaiting their outcome, by request slot.

    Two sets live at a time: the drafts `admit` has just admitted (pending)
    and the ones being verified (`begin_step` swaps them). Arrays, not a
    dict of small objects, so that `admit` and `observe` are a few numpy
    operations per step, not a Python loop over requests (at 256 requests
    that loop cost milliseconds per step). Features stay in the tensors
    `admit` got, on their device; a slot points at its row there.
    """

    def __init__(self, capacity: int, K: int) -> None:
        self.live = np.zeros(capacity, dtype=bool)  # [S] slot has drafts in this set
        self.conf = np.zeros((capacity, K), dtype=np.float32)  # [S, K] predicted acceptance
        self.admitted = np.zeros(capacity, dtype=np.int64)  # [S]
        self.source = np.zeros(capacity, dtype=np.int64)  # [S] index into `features`
        self.row = np.zeros(capacity, dtype=np.int64)  # [S] row in that tensor
        # [S, K] the survival row the slot had before these drafts (what a
        # depth or budget planned for them read), and whether it had one.
        self.prev = np.zeros((capacity, K), dtype=np.float32)
        self.has_prev = np.zeros(capacity, dtype=bool)
        self.features: list[torch.Tensor] = []  # [R, k] per `admit` call

    def clear(self) -> None:
        self.live[:] = False
        self.features = []

    def grow(self, capacity: int) -> None:
        for name in ("live", "conf", "admitted", "source", "row", "prev", "has_prev"):
            setattr(self, name, _grown(getattr(self, name), capacity))

    def gather_features(self, slots: np.ndarray) -> torch.Tensor:
        """[n, k] features of the drafts of `slots`, in that order."""
        source, row = self.source[slots], self.row[slots]
        if len(self.features) == 1:  # the usual case: one `admit` per step
            feats = self.features[0]
            return feats.index_select(0, torch.from_numpy(row).to(feats.device))
        return torch.stack([self.features[s][r] for s, r in zip(source, row)])


def _grown(a: np.ndarray, capacity: int) -> np.ndarray:
    """`a` with its first axis extended to `capacity` (new rows zero)."""
    out = np.zeros((capacity, *a.shape[1:]), dtype=a.dtype)
    out[: len(a)] = a
    return out


# Request slots allocated at start; the tables double when full.
INITIAL_SLOTS = 64

# Exploration (choose_depth): at least one estimator refit window (8 steps)
# between two full-depth steps, and at most one in R // 2 steps. The
# estimator learns a position's intercept only from drafts verified there, so
# a policy that never drafts deep never learns that deep drafts pay (on the
# traces, conditional acceptance rises with depth) and sticks at depth 1 or
# 0. Small batches need frequent exploration (few labels per step); at 256
# requests one step in 128 gives 256 labels per position for about 1/128 of
# a full drafting step.
EXPLORE_MIN_INTERVAL = 8
# ... and, where a full-depth step costs much more than the chosen one (a
# costly drafter, or verifying R * K more tokens at a large batch), no more
# than this share of the time goes to exploring.
EXPLORE_MAX_TIME_SHARE = 0.05
# ... or this share where even drafts that were all accepted could not make
# a full-depth step pay (then exploring can only confirm that; it is kept
# so that a drafter that gets faster is noticed).
EXPLORE_HOPELESS_TIME_SHARE = 0.01
# ... and each exploration after which the policy went on choosing depth 0
# until the next one doubles the interval that follows, up to this factor
# (the time share then falls to 5% / 32, or 1% / 32); the first step the
# policy chooses to draft resets it. Where drafting does not pay (the
# Qwen2.5-Coder pair on the H200 and the H100: depth 0 on 99% of steps,
# the rest explorations) exploring is a cost on every step: on the H100 a
# batch with exploring steps had a 9.5-18.6 ms longer GPU span than one
# without, and half the batches had them at a cap of 8. A drafter that
# starts to pay is still noticed, up to this many times later: in trace
# replays with the H100's costs, a cap of 32 against 8 cut exploring from
# 0.64% / 0.47% of the time to 0.20% / 0.14% at 1 / 64 requests, and
# noticed a change to well-accepted drafts 1.1-16 s after it against
# 0.3-4.9 s (benchmarks/exploration_backoff.py).
EXPLORE_BACKOFF_MAX = 32
# The interval's growth per such exploration. In the same replays over an
# engine's first 1,600 steps, 4 against 2 cut exploring from 0.89% to 0.60%
# of the time at one request and from 0.50% to 0.35% at 64, noticed a change
# at step 800 sooner at one request (278 steps against 768), and at 64
# requests missed it by step 1,600 in 2 of 3 draws (1 of 3 at 2): too few
# draws to prefer 4 (benchmarks/results/cpu_20261207_early_exploration/).
EXPLORE_BACKOFF_FACTOR = 2
# A drafting depth above 0 is chosen only where its expected rate beats
# plain decoding's by this share. Near break-even the choice rests on one
# step's stale rows, whose mean acceptance moves by a few percent from step
# to step, so a zero margin drafts on noise: in trace replays with drafting
# 1.5-1.75x dearer than break-even (costs as the H200's real pair at 64
# requests), the policy drafted at depth 1 on 1-62% of steps, each such
# choice reset the exploration back-off, and it ran 0.9-1.2% below plain
# decoding; with the margin 0.3-0.4%, what exploring costs in that run
# (benchmarks/depth_entry_margin.py). Where drafting pays more than the
# margin the choice is unchanged.
DEPTH_ENTRY_MARGIN = 0.03
# Plain-step probes (choose_depth, with `probe_plain_steps`): while no step
# that verifies no draft has been timed, depth 0 once every this many steps,
# at most PLAIN_PROBES_MAX times, so that B = 0 gets its own measured cost
# where drafting always seemed to pay (a cheap drafter at low load).
PLAIN_PROBE_INTERVAL = 16
PLAIN_PROBES_MAX = 8
# Measured drafting times correct the profiled drafting tables (per depth),
# and measured step times the verification table (per power-of-two bucket
# of token counts): the correction at a key is the median of its last
# CALIBRATION_WINDOW measured / profiled ratios, used once it has
# CALIBRATION_MIN_SAMPLES of them (until then the nearest corrected key's
# stands in). Start-up profiles time dummy runs, which can miss what real
# steps pay: on the H200 with vLLM 0.32, real draft-model steps cost 4-12x
# their profiled dummy runs (the drafter ran outside CUDA graphs), and the
# profiled verification (attention over a synthetic long context) was
# 1.5-2x the real target step. The median, not a running mean, because one
# freak measurement (a first-use initialisation, a stall) can be 100x the
# rest: trusted alone, it priced one-token steps at 100x on the H200 (sixth
# round, async scheduling), the monotone verification table carried that
# to every size, and depth 0, never chosen again at that size, was never
# re-measured. Ratios are clipped to this range.
CALIBRATION_WINDOW = 7
CALIBRATION_MIN_SAMPLES = 3
CALIBRATION_CLIP = (0.05, 100.0)
# A correction that its table has not re-measured over this many timed
# steps gives way to the nearest re-measured key's, while the table keeps
# one. A key is timed only where the policy steps, so a correction taken
# while the machine was loaded (an engine started beside another process)
# and never re-timed would stand for the rest of the run: the cost it
# states keeps the policy away from that size. On the CPU one such bucket
# priced verification at depth 1 at 576 ms against 440 for a plain step,
# and the policy stayed at depth 0 while its explorations, at depth K,
# timed another bucket. Checked every CALIBRATION_EXPIRY_EVERY timed steps.
CALIBRATION_STALE_STEPS = 128
CALIBRATION_EXPIRY_EVERY = 16
# Feature (logit(q_max)) given to undrafted slots before any slot at that
# position was drafted: q_max = 0.88, a confident drafter.
UNDRAFTED_FEATURE = 2.0


def _recent_median(samples: dict, key: int, value: float) -> float | None:
    """Add `value` at `key`; the median of its last CALIBRATION_WINDOW once
    there are CALIBRATION_MIN_SAMPLES of them."""
    recent = samples.setdefault(key, deque(maxlen=CALIBRATION_WINDOW))
    recent.append(float(value))
    return float(np.median(recent)) if len(recent) >= CALIBRATION_MIN_SAMPLES else None


def _update_scale(log_ratios: dict, key: int, ratio: float) -> float | None:
    """Add one measured / predicted ratio at `key`; the correction (median
    of the recent ones, in log space) once there are enough."""
    log_scale = _recent_median(log_ratios, key, np.log(np.clip(ratio, *CALIBRATION_CLIP)))
    return None if log_scale is None else float(np.exp(log_scale))


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
        self.depth_entry_margin = DEPTH_ENTRY_MARGIN
        # Whether choose_depth tallies its depths in `stats` (off where an
        # adapter counts the depths its steps ran, as the MRV2 manager does).
        self.counts_depths = True
        # Per-request state lives in slots of preallocated tables: req_id ->
        # slot, freed by `forget` and reused.
        self._slot: dict[str, int] = {}
        self._free: list[int] = list(range(INITIAL_SLOTS - 1, -1, -1))
        # Survival row [K] of each slot's last drafting step (its first
        # `_stale_width` entries: the width of that step's features).
        self._stale_rows = np.zeros((INITIAL_SLOTS, self.K), dtype=np.float32)  # [S, K]
        self._stale_width = np.zeros(INITIAL_SLOTS, dtype=np.int64)  # [S]
        # What stale rows saw of the next drafts, to plan from (stale_rows.py).
        self.row_calibration = StaleRowCalibration(self.K)
        self._planned_prior = None  # (prior, map version, mapped prior)
        # Admitted drafts of the last `admit`, and of the one before it once
        # `begin_step` says they are being verified.
        self._pending = _Drafts(INITIAL_SLOTS, self.K)
        self._verifying = _Drafts(INITIAL_SLOTS, self.K)
        # Host copies `admit(admit_all=True)` left on the device (async
        # scheduling: no host sync at drafting time), written out by
        # `_materialize`: (slots, rows, width, [2, R, k] tensor, its _Drafts
        # set, a CUDA event or None).
        self._deferred: list[tuple] = []
        # Running sum and count of drafted features per position [K]; their
        # mean stands in for the features of slots a shallow step never drafted.
        self._feat_sum: torch.Tensor | None = None
        self._feat_n: torch.Tensor | None = None
        # Depth of the last chosen step (None before the first) and steps
        # since the last exploration step.
        self._last_depth: int | None = None
        self._since_explore = 0
        # Exploration backoff (EXPLORE_BACKOFF_MAX): the factor on the next
        # interval, and whether the policy chose to draft since the last
        # exploration (None before the first).
        self._explore_scale = 1
        self._drafted_since_explore: bool | None = None
        # Depth-0 probes of the plain verification table (off by default:
        # the vLLM adapter turns them on where plain steps are timed).
        self.probe_plain_steps = False
        self._plain_probes = 0
        self._since_plain_probe = 0
        # Recent log(measured / profiled) per depth and per token bucket.
        self._draft_log_scale: dict[int, deque] = {}
        self._verify_log_scale: dict[int, deque] = {}
        self._plain_log_scale: dict[int, deque] = {}
        # The same ratio for timed steps that carried prompt tokens, kept
        # apart as a diagnostic only (`prefill_step_scale`, never priced):
        # it tells whether a bucket's correction comes from such steps.
        self._prefill_log_scale: dict[int, deque] = {}
        self.prefill_step_scale: dict[int, float] = {}
        # Timed steps so far, and the timed step at which each key of each
        # table (draft, verify, plain) was last measured.
        self._timed_steps = 0
        self._last_timed: dict[str, dict[int, int]] = {"draft": {}, "verify": {}, "plain": {}}
        # Recent measured drafting times per request-count bucket, for
        # drafters with no profiled cost (model-free).
        self._draft_ms: dict[int, deque] = {}
        # The last depth-0-regime choice and what it was computed from.
        self._zero_depth_memo = None
        self._explore_memo = None
        # A run of depth-0 steps whose inputs are unchanged (`_zero_run_key`):
        # (the exploration counter at which the run ends, key, prior).
        self._zero_run = None
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
        may_explore: bool = True,
    ) -> int:
        """Drafting depth d in 0..K for this step, before anything is drafted.

        req_ids: the requests that will draft (decoding, not in prefill).
        num_sampling, num_other_tokens: as for `admit`.
        min_depth: a floor (the vLLM adapter drafts K when a request carries
            its own seed, so that its output depends on its seed alone).
        may_explore: False defers a due exploration step to the next step
            that allows it, for at most one more interval. The vLLM adapter
            passes False while prompt tokens are scheduled: a drafter
            skipped at depth 0 would run over them at full depth, and on
            the H200 one such step on Model Runner V2 held up a quarter of
            a wave's first tokens by about a second.

        For each d the budget B_d is sized from the stale rows cut to depth
        d, with drafting charged at depth d (`CostModel.draft_cost_at_depth`),
        and d maximises the expected rate at B_d; ties go to the shallower d.
        Rows: each request's survival row from its previous drafting step
        (the estimator's prior for a new request); after a step that drafted
        nothing every row is a step older, so we take the estimator's prior
        (its population average) for all, or one bad step would freeze the
        depth at 0 (no drafts, no new rows, no learning). Every
        max(EXPLORE_MIN_INTERVAL, R // 2) steps, or more where full depth is
        dear (`_explore_interval`), and up to EXPLORE_BACKOFF_MAX times that
        while explorations leave the policy at depth 0, the depth is K
        (exploration; the budget still decides what is verified). Takes no
        features: d never depends on this step's drafts.
        """
        R = len(req_ids)
        K = self.K
        if R == 0:
            return max(min_depth, 0)  # nothing decodes: drafts are discarded anyway
        self._since_explore += 1
        self._since_plain_probe += 1
        key = self._zero_run_key(R, num_sampling, num_other_tokens, min_depth, may_explore)
        run = self._zero_run
        if run is not None:
            if self._since_explore < run[0] and run[1] == key and run[2] is self._prior_host():
                # What the search below would answer (see `_keep_zero_run`).
                if self.counts_depths:
                    record_depth(self.stats, 0, K)
                return 0
        was_zero = self._last_depth == 0
        searched = False
        if self._explore_due(R, num_other_tokens, may_explore):
            self._since_explore, d = 0, K
            self._back_off_exploration()
        elif self._plain_probe_due():
            d = 0
        else:
            d = self._best_depth(req_ids, num_sampling, num_other_tokens)
            searched = True
            if d > 0:  # the policy's own choice, before any floor
                self._drafted_since_explore = True
        d = int(min(max(d, min_depth), K))
        self._last_depth = d
        self._zero_run = None
        if searched and was_zero and d == 0:
            self._keep_zero_run(R, num_other_tokens, may_explore, key)
        if self.counts_depths:
            record_depth(self.stats, d, K)
        return d

    def _zero_run_key(self, R: int, num_sampling: int, num_other_tokens: int, min_depth: int,
                      may_explore: bool) -> tuple:
        """Everything a depth-0 step's choice reads besides the prior and
        the exploration counter: the batch's counts, the floor, the costs
        (`_costs_stamp`), the entry margin and the row map's version."""
        return (R, num_sampling, num_other_tokens, min_depth <= 0, may_explore,
                *self._costs_stamp(), self.depth_entry_margin, self.row_calibration.version)

    def _keep_zero_run(self, R: int, num_other_tokens: int, may_explore: bool,
                       key: tuple) -> None:
        """After a step that searched from depth 0 and chose 0: the steps
        that follow with the same key and prior would each search the same
        rows (every row is the prior after a step that drafted nothing,
        `_best_depth`) and find 0, with no plain probe (those follow a
        drafting step only), until exploration is due. Remember when that
        is, so that they answer 0 without the search: under load most steps
        are such steps, and the scheduler asks on every one."""
        floor = max(EXPLORE_MIN_INTERVAL, R // 2)
        interval = self._explore_interval(R, num_other_tokens) * self._explore_scale
        due = max(floor, interval if may_explore else 2 * interval)
        self._zero_run = (due, key, self._prior_host())

    def _explore_due(self, R: int, num_other_tokens: int, may_explore: bool) -> bool:
        """Whether this step explores: its interval has passed and the step
        allows it, or twice its interval has passed (a stream of prompts
        must not starve exploration)."""
        since = self._since_explore
        # The step-count floor first: the interval's cost lookups only once
        # it is reached (the interval is never shorter than that floor).
        if since < max(EXPLORE_MIN_INTERVAL, R // 2):
            return False
        interval = self._explore_interval(R, num_other_tokens) * self._explore_scale
        return since >= (interval if may_explore else 2 * interval)

    def _back_off_exploration(self) -> None:
        """At an exploration step: double the next interval if the policy
        chose depth 0 on every step since the previous exploration, else
        (or at the first) keep the base interval (EXPLORE_BACKOFF_MAX)."""
        if self._drafted_since_explore is False:
            self._explore_scale = min(EXPLORE_BACKOFF_FACTOR * self._explore_scale,
                                     EXPLORE_BACKOFF_MAX)
        else:
            self._explore_scale = 1
        self._drafted_since_explore = False

    def _plain_probe_due(self) -> bool:
        """A depth-0 step to time a plain step (see PLAIN_PROBE_INTERVAL)."""
        if (not self.probe_plain_steps or self.cost.plain_verify_scale
                or self._plain_probes >= PLAIN_PROBES_MAX):
            return False
        if self._since_plain_probe < PLAIN_PROBE_INTERVAL or not self._last_depth:
            return False
        self._since_plain_probe = 0
        self._plain_probes += 1
        return True

    def _costs_stamp(self) -> tuple:
        """What a choice remembered from the costs must match to stay valid:
        the cost model itself, its corrections' version and how depth 0 is
        priced (free, or as the drafter's first forward)."""
        return (self.cost, self.cost.version, self.cost.free_zero_depth,
                self.cost.zero_depth_forward)

    def _explore_interval(self, R: int, num_other_tokens: int) -> int:
        """Steps between two full-depth steps: see EXPLORE_MIN_INTERVAL and
        EXPLORE_MAX_TIME_SHARE (costs at the last chosen depth, verifying
        nothing but the batch's own tokens). Asked every step once the
        step-count floor is passed, so the answer is kept while what it
        reads is unchanged."""
        d = self._last_depth if self._last_depth is not None else self.K
        key = (R, num_other_tokens, d, self._costs_stamp())
        memo = self._explore_memo
        if memo is not None and memo[0] == key:
            return memo[1]
        interval = self._compute_explore_interval(R, num_other_tokens, d)
        self._explore_memo = (key, interval)
        return interval

    def _compute_explore_interval(self, R: int, num_other_tokens: int, d: int) -> int:
        interval = max(EXPLORE_MIN_INTERVAL, R // 2)
        if d < self.K:
            K = self.K
            draft_d = float(self.cost.draft_cost_at_depth(R, d, K))
            draft_k = float(self.cost.draft_cost_at_depth(R, K, K))
            own = (self.cost.plain_verify_cost(num_other_tokens) if d == 0
                   else self.cost.verify_cost(num_other_tokens + R * d))
            base = float(own) + draft_d
            full = float(self.cost.verify_cost(num_other_tokens + R * K)) + draft_k
            # What a full-depth step costs over the chosen one: its drafting
            # and the verification of its R * K drafts.
            extra = full - base
            if base > 0 and extra > 0:
                # Tokens per ms at depth K if every draft were accepted,
                # against depth d with none accepted (a lower bound).
                best_k = (num_other_tokens + R * K) / full
                hopeless = best_k <= num_other_tokens / base
                share = EXPLORE_HOPELESS_TIME_SHARE if hopeless else EXPLORE_MAX_TIME_SHARE
                interval = max(interval, int(np.ceil(extra / (share * base))))
        return interval

    def observe_verify_time(self, num_tokens: int, ms: float, plain: bool = False,
                            prefill: bool = False) -> None:
        """A measured step apart from drafting (`num_tokens` target tokens,
        wall time `ms`): corrects the verification table around that size
        (per power-of-two bucket of token counts), that of steps verifying
        drafts or, `plain`, that of steps verifying none: a plain step
        skips speculative metadata and the rejection sampler, so depth 0 is
        priced as what it runs. `prefill`: the step carried prompt tokens;
        it corrects the table all the same and is also tallied apart
        (`prefill_step_scale`)."""
        if num_tokens <= 0 or not np.isfinite(ms) or ms <= 0:
            return
        predicted = float(self.cost.verify(int(num_tokens)))
        if predicted <= 1e-6:
            return
        bucket = int(np.floor(np.log2(num_tokens)))
        if prefill:
            apart = _update_scale(self._prefill_log_scale, bucket, ms / predicted)
            if apart is not None:
                self.prefill_step_scale[bucket] = apart
        log_scale = self._plain_log_scale if plain else self._verify_log_scale
        scale = _update_scale(log_scale, bucket, ms / predicted)
        if scale is not None:
            self.cost.set_verify_scale(bucket, scale, plain=plain)
        self._timed_steps += 1
        self._last_timed["plain" if plain else "verify"][bucket] = self._timed_steps
        if self._timed_steps % CALIBRATION_EXPIRY_EVERY == 0:
            self._expire_stale_corrections()

    def _expire_stale_corrections(self) -> None:
        """Drop each correction not re-measured over CALIBRATION_STALE_STEPS
        timed steps, where its table keeps a fresher one."""
        now = self._timed_steps
        cost = self.cost
        for table, ratios, applied, drop in (
            ("verify", self._verify_log_scale, cost.verify_scale,
             lambda k: cost.drop_verify_scale(k)),
            ("plain", self._plain_log_scale, cost.plain_verify_scale,
             lambda k: cost.drop_verify_scale(k, plain=True)),
            ("draft", self._draft_log_scale, cost.draft_scale, cost.drop_draft_scale),
        ):
            last = self._last_timed[table]
            stale = [k for k, t in last.items() if now - t > CALIBRATION_STALE_STEPS]
            if not stale or not any(k in applied for k in last.keys() - set(stale)):
                continue
            for k in stale:
                del last[k]
                ratios.pop(k, None)
                drop(k)

    def observe_step_period(self, depth: int, num_reqs: int, ms: float) -> None:
        """A served step's whole period `ms` (depth `depth`, `num_reqs`
        decoding requests, every draft verified): what its drafting does not
        take (as priced) corrects the verification table, that of plain
        steps at depth 0. A period holds the engine's host work per step
        (scheduling, sampling, output), which a profile of forwards misses
        and which a plain step pays per token while a drafting step spreads
        it over its accepted drafts."""
        if num_reqs <= 0:
            return
        drafting = float(self.cost.draft_cost_at_depth(num_reqs, depth, self.K))
        self.observe_verify_time(num_reqs * (1 + depth), ms - drafting, plain=depth == 0)

    def observe_draft_time(self, depth: int, num_reqs: int, ms: float) -> None:
        """A measured drafting step (`depth` tokens for `num_reqs` requests,
        wall time `ms`): corrects the drafting table at that depth."""
        if num_reqs <= 0 or not np.isfinite(ms) or ms <= 0:
            return
        predicted = float(self.cost.profiled_draft_cost(num_reqs, depth, self.K))
        if predicted <= 1e-6:
            # Nothing profiled (model-free drafters): the measured time is
            # the cost, a median per request-count bucket.
            bucket = int(np.floor(np.log2(num_reqs)))
            measured = _recent_median(self._draft_ms, bucket, ms)
            if measured is not None:
                self.cost.set_measured_draft_cost(bucket, measured)
            return
        scale = _update_scale(self._draft_log_scale, depth, ms / predicted)
        if scale is not None:
            self.cost.set_draft_scale(depth, scale)
        self._last_timed["draft"][depth] = self._timed_steps

    def _best_depth(self, req_ids, num_sampling: int, num_other_tokens: int) -> int:
        R, K = len(req_ids), self.K
        if self._last_depth == 0:
            # Every row is the estimator's prior: the choice depends on the
            # batch's counts, the prior and the costs alone, so a run of
            # depth-0 steps with none of them changed repeats it without the
            # search (host time on every step an engine drafts nothing).
            prior = self._planning_prior()  # [K]
            key = (R, num_sampling, num_other_tokens, self._costs_stamp(),
                   self.depth_entry_margin)
            memo = self._zero_depth_memo
            if memo is not None and memo[0] == key and memo[1] is prior:
                return memo[2]
            d = self._search_depth(np.broadcast_to(prior, (R, K)), num_sampling,
                                   num_other_tokens)
            self._zero_depth_memo = (key, prior, d)  # holds `prior`: its id stays its own
            return d
        rows = self.stale_scores(req_ids, np.full(R, K)).reshape(R, K)
        return self._search_depth(rows, num_sampling, num_other_tokens)

    def _search_depth(self, rows: np.ndarray, num_sampling: int, num_other_tokens: int) -> int:
        """The depth whose budget reaches the best rate, shallowest on ties
        (`best_depth`: every depth from one sort of the rows' slots)."""
        R, K = rows.shape
        draft = [float(self.cost.at_depth(d, K).draft_cost(R)) for d in range(K + 1)]
        return best_depth(rows, num_sampling, num_other_tokens, draft, self.cost,
                          entry_margin=self.depth_entry_margin)[0]

    # --------------------------------------------------------------- admit
    def stale_scores(self, req_ids: list[str], num_drafted: np.ndarray) -> np.ndarray:
        """Scores for the budget: each request's previous-step survival row
        (the estimator's prior for a request seen for the first time), cut
        to the number of slots it drafts this step."""
        if self._deferred:
            self._materialize(wait=False)
        num_drafted = np.asarray(num_drafted)
        drafting = num_drafted > 0  # [R]
        n = num_drafted[drafting]  # [m]
        if n.size == 0:
            return np.zeros(0)
        slots = self._slots_of(req_ids)[drafting]  # [m]; -1: seen for the first time
        rows = self._stale_rows[slots]  # [m, K]; rows of slot -1 replaced below
        width = self._stale_width[slots]  # [m]
        new = slots < 0
        if new.any():
            prior = self._prior_host()  # [K]
            rows[new] = prior
            width[new] = len(prior)
        # A row one step old (or the prior), mapped to what such rows saw
        # of the next drafts (stale_rows.py).
        rows = self.row_calibration.apply(rows)
        # Row-major boolean indexing: the rows' prefixes, one after another.
        return rows[np.arange(self.K) < np.minimum(n, width)[:, None]]

    def _planning_prior(self) -> np.ndarray:
        """The prior row as plans read it (mapped, stale_rows.py): the same
        array while neither the prior nor the map changes, so that the
        depth-0 memo holds."""
        prior = self._prior_host()
        cal = self.row_calibration
        if not cal.fitted:
            return prior
        kept = self._planned_prior
        if kept is not None and kept[0] is prior and kept[1] == cal.version:
            return kept[2]
        mapped = cal.apply(np.asarray(prior, dtype=np.float64)[None])[0]
        mapped.flags.writeable = False
        self._planned_prior = (prior, cal.version, mapped)
        return mapped

    def _prior_host(self) -> np.ndarray:
        """The estimator's prior survival [K] on the host (copied once per
        change where the estimator keeps a host copy)."""
        host = getattr(self.estimator, "prior_survival_host", None)
        return host(self.K) if host else self.estimator.prior_survival(self.K).cpu().numpy()

    def _slots_of(self, req_ids) -> np.ndarray:
        """[R] slot of each request, -1 for a request with no state."""
        get = self._slot.get
        return np.fromiter((get(rid, -1) for rid in req_ids), dtype=np.int64, count=len(req_ids))

    def _assign_slots(self, req_ids) -> np.ndarray:
        """[R] slot of each request, allocating one for a new request."""
        slots = np.empty(len(req_ids), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            slot = self._slot.get(rid)
            if slot is None:
                if not self._free:
                    self._grow()
                slot = self._slot[rid] = self._free.pop()
            slots[i] = slot
        return slots

    def _grow(self) -> None:
        old = len(self._stale_width)
        self._stale_rows = _grown(self._stale_rows, 2 * old)
        self._stale_width = _grown(self._stale_width, 2 * old)
        self._pending.grow(2 * old)
        self._verifying.grow(2 * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def admit(
        self,
        req_ids: list[str],
        features: torch.Tensor,
        num_drafted: np.ndarray,
        num_sampling: int,
        num_other_tokens: int,
        admit_all: bool = False,
    ) -> np.ndarray:
        """Decide how many drafts of each request to verify (see
        `admit_fetching`, which this is without a tensor to fetch)."""
        return self.admit_fetching(req_ids, features, num_drafted, num_sampling,
                                   num_other_tokens, admit_all=admit_all)[0]

    def admit_fetching(
        self,
        req_ids: list[str],
        features: torch.Tensor,
        num_drafted: np.ndarray,
        num_sampling: int,
        num_other_tokens: int,
        admit_all: bool = False,
        fetch: torch.Tensor | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Decide how many drafts of each request to verify.

        req_ids: [R] request ids, in the rows' order.
        features: [R, K] lossless features of each drafted slot.
        num_drafted: [R] host ints; slots past it are not drafts (a request
            still in prefill, a short model-free draft).
        num_sampling: requests that will sample a token in the verify step.
        num_other_tokens: tokens of that step that are not drafts.
        admit_all: verify every draft (the engine scheduled them already:
            async scheduling); the drafts are recorded for `observe` as usual.
        fetch: an integer tensor the caller needs on the host as well (the
            drafted token ids, values below 2**53), brought over in the same
            transfer as the admission: on CUDA one wait for the device per
            call, the one an engine that hands drafts to a host scheduler
            pays anyway.
        Returns admitted [R] (host ints, a prefix length per request) and
        `fetch` on the host (int64 numpy, None without it).
        """
        num_drafted = np.asarray(num_drafted, dtype=np.int64)
        R, k = features.shape
        drafted_t = host_to_device(num_drafted, features.device)
        if admit_all:
            budget = int(num_drafted.sum())
        else:
            # Drafter passes this step: the deepest draft (K unless a depth was chosen).
            depth = int(num_drafted.max()) if R else 0
            budget = size_budget(
                self.stale_scores(req_ids, num_drafted),
                num_sampling=num_sampling,
                num_other_tokens=num_other_tokens,
                num_drafting_reqs=int((num_drafted > 0).sum()),
                cost=self.cost.at_depth(depth, self.K),
            )
        features = self._fill_undrafted(features, drafted_t)
        conf = self.estimator.predict(features)  # [R, k]
        surv = survival(conf)  # [R, k]
        stacked = torch.stack([surv.float(), conf.float()])  # [2, R, k]
        fetched = None
        if admit_all:
            admitted = num_drafted.copy()
            if fetch is not None:
                fetched = fetch.cpu().numpy().astype(np.int64)
        else:
            admitted_t = self.selector(surv, drafted_t, budget)  # [R], on device
            admitted, surv_np, conf_np, fetched = _fetch_together(admitted_t, stacked, fetch)

        rows = np.flatnonzero(num_drafted > 0)  # requests that drafted
        ids = [req_ids[r] for r in rows]
        # Requests seen for the first time (read before their slots are
        # assigned): no row came before their drafts, and on the deferred
        # path their row starts as the prior.
        new = self._slots_of(ids) < 0
        slots = self._assign_slots(ids)
        # Before the rows are replaced: what planning for these drafts read.
        self._pending.prev[slots] = self._stale_rows[slots]
        self._pending.has_prev[slots] = ~new
        if admit_all:
            # Nothing here needs the values now: copy them when they are.
            # Until then a new request's row is the prior, not whatever
            # its (reused) slot held.
            if new.any():
                self._stale_rows[slots[new], :k] = self._prior_host()[:k]
            self._defer(slots, rows, k, stacked)
        else:
            self._stale_rows[slots, :k] = surv_np[rows]
            self._pending.conf[slots, :k] = conf_np[rows]
        self._stale_width[slots] = k
        if rows.size:
            p = self._pending
            p.live[slots] = True
            p.admitted[slots] = admitted[rows]
            p.source[slots] = len(p.features)
            p.row[slots] = rows
            p.features.append(features.detach())  # stays on its device for the estimator

        s = self.stats
        s.num_steps += 1
        s.drafted += int(num_drafted.sum())
        s.admitted += int(admitted.sum())
        s.trimmed += int(num_drafted.sum() - admitted.sum())
        s.last_budget = int(budget)
        return admitted, fetched

    def _defer(self, slots: np.ndarray, rows: np.ndarray, k: int, stacked: torch.Tensor) -> None:
        event = None
        if stacked.is_cuda:
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            stacked = host
        self._deferred.append((slots, rows, k, stacked, self._pending, event))

    def _materialize(self, wait: bool = True) -> None:
        """Write deferred host copies out; with `wait=False` only those whose
        copy has finished (the rest stay: a staler row meanwhile)."""
        keep = []
        for entry in self._deferred:
            slots, rows, k, stacked, drafts, event = entry
            if event is not None and not wait and not event.query():
                keep.append(entry)
                continue
            if event is not None:
                event.synchronize()
            surv_np, conf_np = stacked.cpu().numpy()
            self._stale_rows[slots, :k] = surv_np[rows]
            drafts.conf[slots, :k] = conf_np[rows]
        self._deferred = keep

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
        if self._deferred:
            self._materialize()
        self._verifying, self._pending = self._pending, self._verifying
        self._pending.clear()

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
        if any(entry[4] is self._verifying for entry in self._deferred):
            self._materialize()  # the predictions `observe` reads (async scheduling)
        slots = self._slots_of(req_ids)  # [R]
        ver = self._verifying
        # Rows whose drafts are being verified; read once (then dropped).
        rows = np.flatnonzero(slots >= 0)
        rows = rows[ver.live[slots[rows]]]
        ver.live[slots[rows]] = False
        num_verified = np.asarray(num_verified)
        rows = rows[num_verified[rows] > 0]
        slots = slots[rows]
        v = np.minimum(num_verified[rows], ver.admitted[slots]).astype(np.int64)  # [n]
        a = np.minimum(np.asarray(num_accepted)[rows], v).astype(np.int64)  # [n]
        s = self.stats
        s.verified += int(v.sum())
        s.accepted += int(a.sum())
        if learn is not None:
            keep = np.asarray(learn, dtype=bool)[rows]
            slots, v, a = slots[keep], v[keep], a[keep]
        if slots.size == 0:
            return
        had = ver.has_prev[slots]
        if had.any():
            self.row_calibration.add(ver.prev[slots[had]], v[had], a[had])
            s.stale_row_slope = self.row_calibration.slope
        # Calibration: labelled slots are the accepted ones plus the first
        # rejection if it was verified. np.add.at adds in row order, so the
        # float sums are those of a per-request loop, bit for bit.
        pos = np.arange(self.K)
        labelled = pos < np.minimum(a + 1, v)[:, None]  # [n, K]
        np.add.at(s.predicted, np.nonzero(labelled)[1], ver.conf[slots][labelled])
        s.observed += (pos < a[:, None]).sum(0)
        s.labelled += labelled.sum(0)
        self.estimator.observe(
            ver.gather_features(slots), torch.from_numpy(v), torch.from_numpy(a)
        )

    def forget(self, req_ids) -> None:
        """Drop the state of finished or preempted requests."""
        if self._deferred:
            self._materialize()  # before a slot can be reused
        for rid in req_ids:
            slot = self._slot.pop(rid, None)
            if slot is not None:
                self._pending.live[slot] = False
                self._verifying.live[slot] = False
                self._free.append(slot)
