"""Discrete-step simulation of a continuous-batching server at fixed concurrency.

Model:
- C request slots, always full (a closed loop: a finished request is
  replaced at the next step). Slot c serves prompts c, c + C, c + 2C, ...
  (mod the pool size) in that order, and request j of slot c draws its bonus
  coins from the seed (seed, c, j), so every policy replays the same
  requests with the same outcomes; only its decisions differ.
- Every step each request drafts `drafted[r]` tokens at its current output
  position g (features from its tape, see traces.py), the policy admits a
  prefix, the target verifies it: accepted = min(admitted, run[g]), and the
  request emits accepted + 1 tokens (correction or bonus). It finishes when
  g reaches its trace's output length; tokens past it are not counted.
- The step costs StepCost.draft_ms(drafted) + verify_ms(R + sum(admitted))
  + overhead_ms(drafted), R the requests in the step: each request puts its
  last sampled token plus its admitted drafts in the verify forward. No
  prefill, no attention/context-length dependence; scheduler and sampler
  overhead only where the cost table prices it (`overhead_ms`, 0 in the
  built-in tables).
- Throughput is counted over steps [warmup_steps, max_steps): the first
  steps hold the synchronised start and the estimator's cold start.
- `refill=False` replays a batch instead (what an offline benchmark does):
  the C requests start together, a finished one is not replaced, the batch
  shrinks, and the run ends when the last request finishes (or at
  max_steps). Throughput is then output tokens / makespan, tail included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from vllm_av.sim.costs import StepCost
from vllm_av.sim.policies import Policy
from vllm_av.sim.traces import TraceSet


@dataclass
class SimResult:
    policy: str
    concurrency: int
    steps: int  # measured steps (fewer than max_steps - warmup if a batch ends)
    tokens: int  # output tokens in the measured steps
    time_ms: float
    throughput: float  # output tokens / s
    per_user: float  # throughput / C (all slots busy; with refill=False, over the makespan)
    tokens_per_step: float  # per request in the step
    drafted_per_step: float  # per request
    verified_per_step: float  # per request
    accepted_per_step: float  # per request
    finished: int  # requests finished during the whole run

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(
    traces: TraceSet,
    policy: Policy,
    cost: StepCost,
    concurrency: int,
    max_steps: int = 256,
    warmup_steps: int = 32,
    seed: int = 0,
    refill: bool = True,
) -> SimResult:
    C, K = concurrency, traces.K
    P = len(traces.tapes)
    width = traces.max_length + K + 1
    run_tab = np.zeros((C, width), dtype=np.int32)  # [C, width] per slot's current request
    feat_tab = np.zeros((C, width), dtype=np.float32)
    length = np.zeros(C, dtype=np.int64)  # [C]
    pos = np.zeros(C, dtype=np.int64)  # [C] output position g
    seq = np.zeros(C, dtype=np.int64)  # [C] requests started per slot
    req_ids = [""] * C

    def start(c: int) -> None:
        j = int(seq[c])
        tape = traces.tapes[(c + j * C) % P]
        rng = np.random.default_rng([seed, c, j])
        run, feats = tape.instantiate(rng, width - tape.length)
        run_tab[c], feat_tab[c] = run, feats
        length[c], pos[c] = tape.length, 0
        req_ids[c] = f"{c}:{j}"
        seq[c] += 1

    for c in range(C):
        start(c)
    rows = np.arange(C)  # slots in the step (all of them unless refill=False)
    cols = np.arange(K)
    tokens = drafted_sum = verified_sum = accepted_sum = 0
    time_ms = 0.0
    finished = steps = req_steps = 0
    for step in range(max_steps):
        if rows.size == 0:
            break  # refill=False: the batch has finished
        p = pos[rows]  # [R]
        ids = [req_ids[c] for c in rows]
        features = feat_tab[rows[:, None], p[:, None] + cols]  # [R, K]
        true_run = run_tab[rows, p]  # [R]
        drafted, admitted = policy.plan(ids, features, true_run)
        admitted = np.minimum(admitted, drafted)
        accepted = np.minimum(admitted, true_run).astype(np.int64)  # [R]
        policy.observe(ids, admitted, accepted)
        emitted = np.minimum(accepted + 1, length[rows] - p)  # [R], capped at the end
        draft_ms = cost.draft_ms(drafted)
        num_tokens = rows.size + int(admitted.sum())
        rest_ms = float(cost.verify_ms(num_tokens)) + cost.overhead_ms(drafted)
        ms = draft_ms + rest_ms
        if drafted.size and drafted.max() > 0:
            policy.observe_draft_time(int(drafted.max()), int((drafted > 0).sum()), draft_ms)
        policy.observe_verify_time(num_tokens, rest_ms)
        if step >= warmup_steps:
            tokens += int(emitted.sum())
            time_ms += ms
            drafted_sum += int(drafted.sum())
            verified_sum += int(admitted.sum())
            accepted_sum += int(accepted.sum())
            steps += 1
            req_steps += rows.size
        pos[rows] += emitted
        done = rows[pos[rows] >= length[rows]]
        if done.size:
            policy.forget([req_ids[c] for c in done])
            finished += done.size
            if refill:
                for c in done:
                    start(int(c))
            else:
                rows = rows[pos[rows] < length[rows]]

    per_req = max(req_steps, 1)
    thr = tokens / (time_ms / 1e3) if time_ms > 0 else 0.0
    return SimResult(
        policy=getattr(policy, "name", type(policy).__name__),
        concurrency=C,
        steps=steps,
        tokens=tokens,
        time_ms=time_ms,
        throughput=thr,
        per_user=thr / C,
        tokens_per_step=tokens / per_req,
        drafted_per_step=drafted_sum / per_req,
        verified_per_step=verified_sum / per_req,
        accepted_per_step=accepted_sum / per_req,
        finished=finished,
    )


__all__ = ["SimResult", "simulate"]
