"""Catch a draft model's KV cache up over the steps that skipped it.

At depth 0 our AV skips the drafter (option `zero_depth_skips_drafter`), so
a draft model never writes its KV for those steps' tokens, prompts
included. Drafts made later attend over those holes and are accepted far
less: on the H200 (twelfth round, greedy) ours' drafts after depth-0
stretches were accepted at 0.05 where fixed K=1 reached 0.85-0.90. The
estimator learns that low acceptance, so after a long depth-0 stretch
(a load spike) drafting might never resume where it would pay. With option
`drafter_catch_up`, a step that drafts first runs the draft model over each
request's missed positions (one varlen forward per batch of at most
`max_num_batched_tokens` tokens, a prefill with context whose outputs are
dropped), writing the KV it lacks; vLLM's drafter then runs as usual. The
drafts change, never the output distribution: verification is unchanged.

Tracked per request: the first position whose draft KV may be missing or
stale (`valid_end`). A request starts at its first scheduled position
(vLLM trusts the draft KV of prefix-cached blocks, and so do we; a block
cached while the drafter was skipped carries its holes). A step that skips
the drafter lowers it to the step's first position (the previous step's
rejected drafts left stale KV above that); a drafting step sets it past the
step's scheduled tokens. The missed tokens come from the runner's host
copy of each request's tokens under synchronous scheduling; async
scheduling leaves that copy unfilled, so there each skipped step's input
tokens are recorded on the device instead (one scatter per skipped step
into a [max_num_seqs, max_model_len] table, rows reused as requests
finish), from where the catch-up gathers them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger("vllm.vllm_av")


class DrafterCatchUp:
    """Per-request draft-KV bookkeeping and the catch-up forward."""

    def __init__(self, max_tokens: int, record_shape: tuple[int, int] | None = None,
                 device=None):
        self.max_tokens = max_tokens  # per forward (the compiled range)
        # Async scheduling: skipped steps' input tokens, by (row, position).
        self.record_shape = record_shape
        self.device = device
        self.recorded: torch.Tensor | None = None  # allocated at the first skip
        self.record_row: dict[str, int] = {}
        self.free_rows: list[int] = []
        self.valid_end: dict[str, int] = {}
        # Every tracked request already lowered since the last drafting step.
        self.lowered = False
        self.tokens_total = 0
        self.forwards_total = 0

    # -- bookkeeping -------------------------------------------------------
    def begin_step(self, scheduler_output) -> None:
        """New and resumed requests start at their first scheduled position;
        finished and preempted ones are dropped."""
        for rid in (*scheduler_output.finished_req_ids,
                    *(scheduler_output.preempted_req_ids or ())):
            self.valid_end.pop(rid, None)
            row = self.record_row.pop(rid, None)
            if row is not None:
                self.free_rows.append(row)
        for req in scheduler_output.scheduled_new_reqs:
            self.valid_end[req.req_id] = req.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        if resumed:
            for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
                if rid in resumed:
                    self.valid_end[rid] = n

    @property
    def skip_needs_rows(self) -> bool:
        """Whether `skipped` has anything to do: a record to write, or
        requests not yet lowered since the last drafting step."""
        return self.record_shape is not None or not self.lowered

    def skipped(self, rows: list[tuple[str, int, int]], runner=None) -> None:
        """A step that did not run the drafter; `rows`: (request id, first
        position, scheduled tokens) of the step. With a record (async
        scheduling) the step's input tokens are recorded from `runner`."""
        if self.record_shape is not None:
            self._record(runner, rows)
        if self.lowered:
            return  # nothing was drafted since: every request is at or below
        for rid, start, _ in rows:
            if self.valid_end.get(rid, start) > start:
                self.valid_end[rid] = start
        self.lowered = True

    def _record(self, runner, rows) -> None:
        """Scatter this step's input tokens into the record, at each
        request's row and each token's position (both as the target read
        them: its input ids and positions buffers, on the device)."""
        if self.recorded is None:
            self.recorded = torch.zeros(self.record_shape, dtype=torch.int32,
                                        device=self.device)
            self.free_rows = list(range(self.record_shape[0] - 1, -1, -1))
            self._stage = _Staging(self.max_tokens, self.device)
        counts = np.array([n for _, _, n in rows], dtype=np.int64)
        num_tokens = int(counts.sum())
        if num_tokens == 0:
            return
        rows_of = np.array([self._record_row(rid) for rid, _, _ in rows], dtype=np.int64)
        row_of_token = self._stage.to_device(np.repeat(rows_of, counts))
        positions = runner.positions[:num_tokens]
        self.recorded[row_of_token, positions] = runner.input_ids.gpu[:num_tokens]

    def _record_row(self, rid: str) -> int:
        row = self.record_row.get(rid)
        if row is None:
            row = self.record_row[rid] = self.free_rows.pop()
        return row

    def recorded_tokens(self, rids: list[str], positions: np.ndarray,
                        lens: np.ndarray) -> torch.Tensor:
        """The recorded tokens of `rids` at `positions` (`lens` per request)."""
        rows_of = np.array([self.record_row[rid] for rid in rids], dtype=np.int64)
        row_of_token = torch.from_numpy(np.repeat(rows_of, lens)).to(
            self.device, non_blocking=True)
        pos = torch.from_numpy(positions).to(self.device, non_blocking=True)
        return self.recorded[row_of_token, pos]

    def holes(self, rows: list[tuple[str, int, int]]) -> list[tuple[int, str, int, int]]:
        """(row, request id, first missed position, step's first position)
        of every request with positions the drafter has not written."""
        out = []
        for row, (rid, start, _) in enumerate(rows):
            end = self.valid_end.get(rid, start)
            if end < start and (self.record_shape is None or rid in self.record_row):
                out.append((row, rid, end, start))
        return out

    def drafted(self, rows: list[tuple[str, int, int]]) -> None:
        """A step whose drafter ran over its scheduled tokens."""
        for rid, start, n in rows:
            if n > 0:
                self.valid_end[rid] = start + n
        self.lowered = False

    # -- the forward -------------------------------------------------------
    def catch_up(self, runner, holes: list[tuple[int, str, int, int]]) -> int:
        """Run the draft model over the holes; returns the tokens run."""
        pieces = _split(holes, self.max_tokens)
        total = 0
        for batch in _batches(pieces, self.max_tokens):
            total += _forward(runner, batch, self)
            self.forwards_total += 1
        self.tokens_total += total
        return total


class _Staging:
    """Host-to-device copies of per-token indices that never make the host
    wait for the device (async scheduling): two pinned buffers used in
    turn, each reused only once its previous copy is done (else a fresh
    one is taken)."""

    def __init__(self, size: int, device):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        cuda = self.device.type == "cuda"
        self.buffers = [torch.empty(size, dtype=torch.int64, pin_memory=cuda)
                        for _ in range(2)]
        self.events = [None, None]
        self.turn = 0

    def to_device(self, values: np.ndarray) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(values)
        i, self.turn = self.turn, 1 - self.turn
        n = len(values)
        busy = self.events[i] is not None and not self.events[i].query()
        if busy or n > len(self.buffers[i]):
            self.buffers[i] = torch.empty(max(n, len(self.buffers[i])), dtype=torch.int64,
                                          pin_memory=True)
        buf = self.buffers[i][:n]
        buf.numpy()[:] = values
        out = buf.to(self.device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return out


def step_rows(runner, scheduler_output) -> list[tuple[str, int, int]]:
    """(request id, first position, scheduled tokens) per row of the
    runner's batch, in row order."""
    batch = runner.input_batch
    scheduled = scheduler_output.num_scheduled_tokens
    starts = batch.num_computed_tokens_cpu
    return [(rid, int(starts[i]), scheduled.get(rid, 0))
            for i, rid in enumerate(batch.req_ids)]


def _split(holes, max_tokens: int) -> list[tuple[int, int, int, str]]:
    """Each hole as pieces of at most `max_tokens` positions, in order:
    (row, first position, end, request id)."""
    pieces = []
    for row, rid, a, s in holes:
        for lo in range(a, s, max_tokens):
            pieces.append((row, lo, min(lo + max_tokens, s), rid))
    return pieces


def _batches(pieces, max_tokens: int):
    """Consecutive pieces grouped into forwards of at most `max_tokens`
    tokens. A hole longer than that is split into pieces of exactly
    `max_tokens`, each a forward of its own, run in order: every query
    attends to KV the earlier forwards wrote."""
    batch, size = [], 0
    for p in pieces:
        n = p[2] - p[1]
        if batch and size + n > max_tokens:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += n
    if batch:
        yield batch


def _forward(runner, pieces: list[tuple[int, int, int, str]], cu: DrafterCatchUp) -> int:
    """One draft-model forward over `pieces` (row, first position, end,
    request id), each a query over the request's own context up to its
    end."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    drafter = runner.drafter
    device = runner.device
    batch = runner.input_batch
    table = batch.block_table[drafter.kv_cache_gid]
    rows = np.array([p[0] for p in pieces], dtype=np.int64)
    starts = np.array([p[1] for p in pieces], dtype=np.int64)
    ends = np.array([p[2] for p in pieces], dtype=np.int64)
    lens = ends - starts
    num_tokens = int(lens.sum())
    row_of_token = np.repeat(rows, lens)
    positions = np.concatenate([np.arange(a, e) for a, e in zip(starts, ends)])
    block_size = table.block_size
    block_ids = table.get_numpy_array()[row_of_token, positions // block_size]
    slots = block_ids.astype(np.int64) * block_size + positions % block_size
    query_start = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lens, out=query_start[1:])

    # Plain copies: the catch-up runs only on the first drafting step after
    # skipped ones, and its forward dwarfs a wait for the device.
    def dev(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype,
                                                             non_blocking=True)

    positions_t = dev(positions, torch.int64)
    slot_mapping = dev(slots, torch.int64)
    query_start_cpu = torch.from_numpy(query_start)
    seq_lens_cpu = torch.from_numpy(ends.astype(np.int32))
    cad = CommonAttentionMetadata(
        query_start_loc=query_start_cpu.to(device, non_blocking=True),
        query_start_loc_cpu=query_start_cpu,
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        seq_lens_cpu_upper_bound=seq_lens_cpu,
        num_reqs=len(pieces),
        num_actual_tokens=num_tokens,
        max_query_len=int(lens.max()),
        max_seq_len=int(ends.max()),
        block_table_tensor=table.get_device_tensor(batch.num_reqs)[dev(rows, torch.int64)],
        slot_mapping=slot_mapping,
        causal=True,
        positions=positions_t,
    )
    if cu.record_shape is not None:
        token_ids = cu.recorded_tokens([p[3] for p in pieces], positions, lens)
    else:
        token_ids = dev(batch.token_ids_cpu[row_of_token, positions], torch.int32)
    _, per_layer = drafter.build_per_group_and_layer_attn_metadata(cad)
    with set_forward_context(per_layer, drafter.vllm_config, num_tokens=num_tokens,
                             cudagraph_runtime_mode=CUDAGraphMode.NONE,
                             slot_mapping={name: slot_mapping
                                           for name in drafter._draft_attn_layer_names}):
        drafter.model(input_ids=token_ids, positions=positions_t, inputs_embeds=None)
    return num_tokens


_CATCH_UP_ATTR = "_vllm_av_catch_up"


def catch_up_of(runner, options) -> DrafterCatchUp | None:
    """The runner's DrafterCatchUp when option `drafter_catch_up` is on and
    applies (a draft-model drafter), else None."""
    if options is None or not options.drafter_catch_up:
        return None
    cu = getattr(runner, _CATCH_UP_ATTR, None)
    if cu is not None:
        return cu or None
    drafter = getattr(runner, "drafter", None)
    spec = getattr(runner, "speculative_config", None)
    if spec is None or spec.method != "draft_model" or not getattr(
            drafter, "_draft_attn_layer_names", None):
        logger.warning("vllm-av: drafter_catch_up is off: it applies to draft-model "
                       "drafters only")
        setattr(runner, _CATCH_UP_ATTR, False)
        return None
    record = None
    if getattr(runner, "use_async_scheduling", False):
        record = (runner.max_num_reqs, runner.max_model_len)
    cu = DrafterCatchUp(runner.scheduler_config.max_num_batched_tokens, record,
                        getattr(runner, "device", None))
    setattr(runner, _CATCH_UP_ATTR, cu)
    return cu
