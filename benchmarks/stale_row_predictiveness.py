"""How well a request's one-step-old survival row predicts its next drafts
(trace replay), the reason for vllm_av/core/stale_rows.py.

    python benchmarks/stale_row_predictiveness.py \
        --out benchmarks/results/cpu_20261205_stale_rows/predictiveness.json

Ours with raw rows (the map kept at the identity) replays the labelled
drafts of the real pair (../shared/data/traces) under this CPU's real-pair
costs (as benchmarks/stale_row_replay.py), seed 0, 1,500 steps. At each
step after the first 100 it records, per request, the row the depth is
planned from and the accepted run the request's next block has in the
trace; per position, the rows are cut into quartiles of their predicted
survival and each quartile's mean prediction is set beside the share of
next blocks that survived that far. A planning replay, not a measurement
of an engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from stale_row_replay import DEFAULT_PERIODS, DEFAULT_PROFILE, K, RawRows, cpu_real_pair  # noqa: E402

from vllm_av.sim import StepCost, load_traces, simulate  # noqa: E402


class Recording(RawRows):
    """Raw rows; records (planning rows, next block's accepted run)."""

    def __init__(self, K, step_cost):
        super().__init__(K, step_cost)
        self.pairs = []

    def plan(self, req_ids, features, true_run):
        v, R = self.verifier, len(req_ids)
        if v._last_depth:
            rows = v.stale_scores(req_ids, np.full(R, K)).reshape(R, K)
        else:  # after a depth-0 step the depth plans from the prior for all
            rows = np.broadcast_to(v._prior_host(), (R, K))
        self.pairs.append((np.array(rows), np.minimum(true_run, K)))
        return super().plan(req_ids, features, true_run)


def quartiles(pairs, skip: int = 100) -> list[dict]:
    rows = np.concatenate([r for r, _ in pairs[skip:]])
    run = np.concatenate([t for _, t in pairs[skip:]])
    out = []
    for j in range(K):
        s = rows[:, j]
        survived = run > j
        edges = np.quantile(s, [0.25, 0.5, 0.75])
        q = np.searchsorted(edges, s, side="right")  # 0..3
        out.append({"position": j + 1, "quartiles": [
            {"predicted": float(s[q == b].mean()), "survived": float(survived[q == b].mean()),
             "n": int((q == b).sum())} for b in range(4) if (q == b).any()]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "data" / "traces")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    step = StepCost(cpu_real_pair(DEFAULT_PERIODS, DEFAULT_PROFILE), K)
    cells = []
    for trace in load_traces(args.traces):
        for C in (int(c) for c in args.concurrency.split(",")):
            pol = Recording(K, step)
            simulate(trace, pol, step, C, args.steps, 50, seed=0)
            table = quartiles(pol.pairs)
            cells.append({"dataset": trace.name, "concurrency": C, "positions": table})
            for j in (0, K - 1):
                qs = table[j]["quartiles"]
                print(f"{trace.name:9s} C={C} position {j + 1}: " + ", ".join(
                    f"{q['predicted']:.2f} -> {q['survived']:.2f}" for q in qs), flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python benchmarks/stale_row_predictiveness.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "cells": cells}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
