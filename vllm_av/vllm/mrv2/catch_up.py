"""Drafter catch-up on Model Runner V2 (option drafter_catch_up).

With adaptive depth a depth-0 step skips the draft model
(MRV2DraftDepthPatch), so the draft model's KV cache never receives the
positions that step computed, prompt chunks included. Drafts made over
those holes are poor (seventeenth H200 round: 19% accepted at the first
position against fixed K=1's 71-90%), the estimator learns that drafting
does not pay, and the depth stays at 0. Running the drafter's first
forward on every depth-0 step (option zero_depth_skips_drafter off) keeps
the cache whole at the price of a drafter forward per step.

The catch-up fills the holes when the drafter next runs instead: vLLM's
first draft forward already lays out, per request, the step's accepted
tokens and the correction token; each request's rows are widened at the
front by the positions it may have missed, read from the runner's token
history (`RequestState.all_token_ids`, which holds every prompt and
sampled token by position). One forward then writes the missed KV and
drafts, and depth-0 steps stay plain.

The host knows how far back to reach without reading the device:
`CatchUpLedger` adds up, per request, the tokens scheduled on the steps
that skipped the drafter (an upper bound on the positions missed: the
first skipped step after a drafting one may verify drafts that are then
rejected). Reaching further back than needed rewrites positions whose KV
is already right with the same tokens, which changes nothing. A window is
capped at a lower bound of the request's first position, so it never
reaches before the sequence, and the windows of one step at the room the
drafter's input buffers have left; what a cap leaves out stays a hole
(counted in `dropped`). The bound is the scheduler's count of computed
tokens less the drafts it may still hold that were rejected: at most the
drafts of the last steps, so after a run of depth-0 steps it is exact and
a window reaches back to the sequence's first position (a skipped prompt
caught up whole, its first tokens included).

Nothing here reads a drafted token: the windows come from the schedule
(DESIGN 2.5).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from vllm_av.core.transfer import host_to_device
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")


# How many of the latest drafting depths bound the rejected drafts the
# scheduler's count may still hold: that count is read when a step is
# scheduled, under async scheduling before the outputs of the one or two
# steps before it are known, whose drafts were proposed one step earlier
# still. Three covers both with one to spare.
RECENT_DEPTHS = 3


class CatchUpLedger:
    """Per request slot (vLLM's request-state index): how many positions
    before its next query the draft model may have missed; and the depths
    the latest steps drafted, which bound how far the scheduler's count of
    computed tokens may run ahead of a request's first query position."""

    def __init__(self, max_num_reqs: int, K: int) -> None:
        self.K = K
        self.behind = np.zeros(max_num_reqs, dtype=np.int64)
        self.owner: list[str | None] = [None] * max_num_reqs
        self.tokens_total = 0  # positions run again in windows, all steps
        self.dropped = 0  # positions a cap left as holes, all steps
        # Unknown before the first steps: as if each had drafted K.
        self.recent = [K] * RECENT_DEPTHS

    def drafted(self, depth: int) -> None:
        """This step proposed `depth` tokens per request (0: skipped)."""
        self.recent = self.recent[1:] + [int(depth)]

    def count_slack(self) -> int:
        """How far the scheduler's count of computed tokens may be ahead of
        a decoding request's first query position: the rejected drafts it
        may still hold, at most two steps' of K (the bound before the
        ledger knew the depths), and at most what the latest steps drafted."""
        return min(2 * self.K, sum(self.recent))

    def _claim(self, req_ids, slots) -> None:
        # A slot handed to another request starts with nothing missed.
        for rid, s in zip(req_ids, slots):
            if self.owner[s] != rid:
                self.owner[s] = rid
                self.behind[s] = 0

    def skipped(self, req_ids, slots, query_lens) -> None:
        """The drafter did not run over this step's queries."""
        slots = np.asarray(slots)
        self._claim(req_ids, slots)
        self.behind[slots] += np.asarray(query_lens, dtype=np.int64)

    def windows(self, req_ids, slots, first_position_lb, room: int) -> np.ndarray:
        """The drafter runs over this step's queries: per request, how many
        positions before its query to run it over too, and then nothing is
        missed. `first_position_lb`: a lower bound of each query's first
        position; `room`: the rows the input buffers have left."""
        slots = np.asarray(slots)
        self._claim(req_ids, slots)
        want = self.behind[slots]
        w = np.minimum(want, np.maximum(np.asarray(first_position_lb, dtype=np.int64), 0))
        # Fill the room in batch order; a request that does not fit gets
        # what is left.
        room = max(int(room), 0)
        total = np.cumsum(w)
        over = total > room
        if over.any():
            w = np.where(over, np.maximum(room - (total - w), 0), w)
        self.tokens_total += int(w.sum())
        self.dropped += int((want - w).sum())
        self.behind[slots] = 0
        return w


@dataclasses.dataclass
class CatchUpPlan:
    """One step's windows, for the layout of the drafter's first forward."""

    windows: np.ndarray  # [num_reqs] positions before each query
    query_start_loc_np: np.ndarray  # the host's, [num_reqs + 1]: sizes the rows


# The token history of the engine this process serves (one per process),
# its drafter's ledger and the plan of the drafting step in flight, if it
# has windows.
_STATE: dict = {"history": None, "ledger": None, "plan": None}


def bind_token_history(all_token_ids) -> None:
    """The runner's RequestState.all_token_ids (its `.gpu` view is read)."""
    _STATE["history"] = all_token_ids


def bind_ledger(ledger: CatchUpLedger) -> None:
    _STATE["ledger"] = ledger


def positions_caught_up() -> int:
    """Positions run again in windows so far (for /metrics)."""
    ledger = _STATE["ledger"]
    return ledger.tokens_total if ledger is not None else 0


def positions_left_as_holes() -> int:
    """Positions missed that no window reached so far (for /metrics)."""
    ledger = _STATE["ledger"]
    return ledger.dropped if ledger is not None else 0


def set_plan(plan: CatchUpPlan | None) -> None:
    _STATE["plan"] = plan


def row_shifts(windows: np.ndarray) -> np.ndarray:
    """How far each request's rows move in the drafter's first forward
    against the target's query (`n + 1` entries, the last the total):
    one correction row for each request before it, as in vLLM's layout,
    and the windows before it. Added on the device to the target's
    query_start_loc, which under our trimming holds the verified lengths
    (the host's copy deals the step's budget round-robin: only its total
    is right)."""
    n = len(windows)
    out = np.arange(n + 1, dtype=np.int64)
    out[1:] += np.cumsum(windows, dtype=np.int64)
    return out


def _kernel():
    from vllm.triton_utils import tl, triton

    @triton.jit
    def caught_up_inputs(
        target_ids_ptr, target_pos_ptr, history_ptr, history_stride,
        last_sampled_ptr, idx_mapping_ptr, query_start_loc_ptr, seq_lens_ptr,
        num_rejected_ptr, out_starts_ptr, windows_ptr, windows_offset,
        out_ids_ptr, out_pos_ptr, last_index_ptr, out_seq_lens_ptr,
        max_model_len, BLOCK: tl.constexpr,
    ):
        # One request: [window from the history | accepted tokens |
        # correction token | rejected rows], positions consecutive.
        i = tl.program_id(0)
        slot = tl.load(idx_mapping_ptr + i).to(tl.int64)
        q0 = tl.load(query_start_loc_ptr + i)
        n_query = tl.load(query_start_loc_ptr + i + 1) - q0
        n_valid = n_query - tl.load(num_rejected_ptr + i)
        w = tl.load(windows_ptr + windows_offset + i).to(tl.int32)
        first = tl.load(out_starts_ptr + i)
        start = tl.load(target_pos_ptr + q0)
        correction = tl.load(last_sampled_ptr + slot).to(tl.int32)
        total = w + n_query + 1
        for b in range(0, total, BLOCK):
            j = b + tl.arange(0, BLOCK)
            live = j < total
            k = j - w
            in_window = k < 0
            pos = start + k
            old = tl.load(history_ptr + slot * history_stride + pos,
                          mask=live & in_window, other=0)
            new = tl.load(target_ids_ptr + q0 + k, mask=live & (k >= 0) & (k < n_valid), other=0)
            ids = tl.where(in_window, old, tl.where(k == n_valid, correction, new))
            tl.store(out_ids_ptr + first + j, ids.to(tl.int32), mask=live)
            tl.store(out_pos_ptr + first + j, tl.minimum(pos, max_model_len - 1), mask=live)
        tl.store(last_index_ptr + i, first + w + n_valid)
        tl.store(out_seq_lens_ptr + i, tl.minimum(tl.load(seq_lens_ptr + i) + 1, max_model_len))

    return caught_up_inputs


_KERNEL: dict = {}


def lay_out_caught_up_inputs(plan: CatchUpPlan, history, input_buffers, input_batch,
                             last_sampled, num_rejected, expanded_input_ids,
                             expanded_positions, last_token_indices, max_num_reqs: int,
                             max_model_len: int) -> int:
    """The drafter's first-forward inputs with each request's window in
    front (the layout of vLLM's own, widened); returns the row count.
    Writes the expanded query_start_loc and seq_lens into `input_buffers`
    and the last row of each request's accepted tokens (the correction
    row) into `last_token_indices`, as vLLM's layout does."""
    if "k" not in _KERNEL:
        _KERNEL["k"] = _kernel()
    n = input_batch.num_reqs
    device = expanded_input_ids.device
    packed_dev = host_to_device(
        np.concatenate((row_shifts(plan.windows), plan.windows.astype(np.int64))), device)
    # Each request's first row: the target's device query start (the
    # caller's batch carries the widened host copy, for vLLM's metadata
    # build), shifted; past the batch, all at the total, as vLLM's layout.
    qsl_buf = input_buffers.query_start_loc
    qsl_buf[: n + 1].copy_(input_batch.query_start_loc[: n + 1].to(torch.int64)
                           + packed_dev[: n + 1])
    qsl_buf[n + 1 : max_num_reqs + 1].copy_(qsl_buf[n : n + 1].expand(max_num_reqs - n))
    input_buffers.seq_lens[n:max_num_reqs].zero_()
    last_token_indices[n:max_num_reqs].zero_()
    _KERNEL["k"][(n,)](
        input_batch.input_ids, input_batch.positions, history, history.stride(0),
        last_sampled, input_batch.idx_mapping, input_batch.query_start_loc,
        input_batch.seq_lens, num_rejected.int(), qsl_buf, packed_dev, n + 1,
        expanded_input_ids, expanded_positions, last_token_indices, input_buffers.seq_lens,
        max_model_len, BLOCK=128,
    )
    # Rows to run: the scheduled upper bound, as vLLM's layout returns;
    # rows past the device total belong to no request.
    return int(plan.query_start_loc_np[n]) + n + int(plan.windows.sum())


def rows_capacity(speculator) -> int:
    """How many rows the drafter's first forward may have: its input
    buffers hold max_num_tokens + max_num_reqs, but its compiled model
    takes at most max_num_tokens (the engine's max_num_batched_tokens:
    past it, vLLM 0.32's compiled forward asserts "Shape 8448 out of
    considered ranges: [(1, 8192)]", as the eighteenth H200 round's
    catch-up arms did at 64-128 concurrent requests)."""
    return min(int(speculator.expanded_input_ids.shape[0]), int(speculator.max_num_tokens))


def plan_for(ledger: CatchUpLedger, input_batch, capacity: int):
    """This drafting step's windows: (the batch vLLM's first forward should
    see, the plan), or (the batch, None) when no request missed anything."""
    n = input_batch.num_reqs
    room = capacity - input_batch.num_tokens - n
    w = ledger.windows(input_batch.req_ids[:n], input_batch.idx_mapping_np[:n],
                       first_position_lower_bound(input_batch, ledger.count_slack()), room)
    if not w.any():
        return input_batch, None
    plan = CatchUpPlan(w, np.array(input_batch.query_start_loc_np[: n + 1], copy=True))
    return widened_batch(input_batch, w), plan


def widened_batch(input_batch, windows: np.ndarray):
    """`input_batch` as vLLM's first-forward code must see it once windows
    widen it: its host query_start_loc and token count include them (they
    size the metadata build and pick the drafter's graph); device fields
    stay the target's."""
    n = input_batch.num_reqs
    qsl = np.array(input_batch.query_start_loc_np, copy=True)
    qsl[1 : n + 1] += np.cumsum(windows)
    qsl[n + 1 :] = qsl[n]
    return dataclasses.replace(input_batch, query_start_loc_np=qsl,
                               num_tokens=input_batch.num_tokens + int(windows.sum()))


def first_position_lower_bound(input_batch, slack: int) -> np.ndarray:
    """A lower bound of each request's first query position, on the host:
    the runner's count of computed tokens is the scheduler's, which may
    still include up to `slack` rejected drafts (async scheduling:
    `CatchUpLedger.count_slack`); prompt chunks' counts are exact."""
    n = input_batch.num_reqs
    computed = np.asarray(input_batch.num_computed_tokens_np[:n], dtype=np.int64)
    prefilling = np.asarray(input_batch.is_prefilling_np[:n], dtype=bool)
    return np.where(prefilling, computed, computed - slack)


class MRV2CatchUpInputsPatch(VllmPatch):
    """Lay out the drafter's first forward with the positions it missed.

    Target: vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator.prepare_prefill_inputs
    Why: with adaptive depth a depth-0 step skips the draft model, whose KV
        cache then has holes at every position computed meanwhile; drafts
        over them are rarely accepted, and the estimator learns from them
        that drafting never pays (seventeenth H200 round).
    How: with option drafter_catch_up, a drafting step whose requests
        missed positions (`CatchUpLedger`, kept by MRV2DraftDepthPatch)
        hands vLLM's first draft forward a batch widened by those windows;
        this layout then reads each window's tokens from the runner's token
        history and puts them in front of the request's rows. Any other
        call runs vLLM's layout unchanged.
    Upstream: none needed while vLLM's V2 draft model drafts every step.
    Remove when: adaptive depth leaves V2's drafter cache whole some other way.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator"
    attributes = ("prepare_prefill_inputs",)
    platforms = ("cuda",)

    def prepare_prefill_inputs(input_buffers, input_batch, last_sampled, num_rejected,
                               expanded_input_ids, expanded_positions, last_token_indices,
                               max_num_reqs, max_model_len):
        plan, history = _STATE["plan"], _STATE["history"]
        if plan is None or history is None:
            module = MRV2CatchUpInputsPatch.resolve_target()
            return module._orig_prepare_prefill_inputs(
                input_buffers, input_batch, last_sampled, num_rejected, expanded_input_ids,
                expanded_positions, last_token_indices, max_num_reqs, max_model_len)
        return lay_out_caught_up_inputs(
            plan, history.gpu, input_buffers, input_batch, last_sampled, num_rejected,
            expanded_input_ids, expanded_positions, last_token_indices, max_num_reqs,
            max_model_len)
