"""The drafting depth our policy would choose, offline: a saved cost table
(as a server writes it at VLLM_AV_COST_TABLE_OUT) and survival rows
measured by a fixed-K arm of a sweep (vLLM's per-position acceptance
rates: the share of drafts whose first i+1 tokens were accepted).

    python benchmarks/depth_plan.py --cost-table T.json --sweep DIR --arm k7g \\
        --out benchmarks/results/depth_plan_round14.json

For each concurrency C of the arm: C requests, each with the arm's
measured survival row, and for each depth d the best budget's modelled
rate (tokens per ms, `best_budget` at `CostModel.at_depth(d, K)`), once
with depth 0 skipping the drafter (free) and once with depth 0 running
its first forward (`zero_depth_forward`). This is planning from the
tables, not a measurement of an engine: it shows what the tables make the
policy do, to set beside what the engine measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from vllm_av.core.budget import best_budget
from vllm_av.core.cost_model import CostModel

MODES = {"depth 0 skips the drafter": (True, False),
         "depth 0 runs its first forward": (False, True)}


def plan(cost: CostModel, survival: np.ndarray, concurrency: int) -> dict:
    """Modelled rate per depth and the chosen depth, for each MODES entry."""
    K = len(survival)
    rows = np.broadcast_to(survival, (concurrency, K))
    out = {}
    for mode, (free, forward) in MODES.items():
        cost.free_zero_depth, cost.zero_depth_forward = free, forward
        rates = [float(best_budget(rows[:, :d].ravel(), concurrency, concurrency,
                                   concurrency, cost.at_depth(d, K))[1]) for d in range(K + 1)]
        out[mode] = {"depth": int(np.argmax(rates)), "tokens_per_ms": [round(r, 4) for r in rates]}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cost-table", required=True)
    p.add_argument("--sweep", required=True, help="a sweep folder with <arm>_c<C>.json")
    p.add_argument("--arm", required=True, help="a fixed-K arm at the table's K")
    p.add_argument("--out", default="")
    args = p.parse_args()
    cost = CostModel.from_json(Path(args.cost_table).read_text())
    result = {"cost_table": args.cost_table, "sweep": args.sweep, "arm": args.arm, "runs": []}
    for path in sorted(Path(args.sweep).glob(f"{args.arm}_c*.json"),
                       key=lambda q: int(q.stem.rsplit("_c", 1)[1])):
        c = int(path.stem.rsplit("_c", 1)[1])
        survival = np.asarray(json.loads(path.read_text())["spec_decode_per_position_acceptance_rates"])
        run = {"concurrency": c, "survival": survival.round(3).tolist(), **plan(cost, survival, c)}
        result["runs"].append(run)
        print(f"C={c}: survival {survival.round(2)[:3]} ... -> "
              + "; ".join(f"{m}: depth {v['depth']} ({v['tokens_per_ms'][0]:.2f} tok/ms at 0, "
                          f"{v['tokens_per_ms'][1]:.2f} at 1)" for m, v in run.items()
                          if m in MODES))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
