"""Trace replay of ours' drafting depth with and without the map of stale
rows (vllm_av/core/stale_rows.py), beside every fixed K.

    python benchmarks/stale_row_replay.py \
        --out benchmarks/results/cpu_20261205_stale_rows/replay.json

The simulator of docs/simulator.md (closed loop, C requests always busy,
synchronous scheduling: depth, drafts, admission, verification) replays
the real pair's labelled drafts (../shared/data/traces) under three step
costs:

- `cpu_real_pair`: this CPU with the real Qwen2.5-Coder pair, from the
  step periods our engine measured by depth (`--periods`, written by
  benchmarks/step_periods_by_depth.py; 141 ms for a plain step of one
  request and 57 ms more per drafted position on 2026-12-05), shaped over
  tokens and requests by a start-up profile of the served main job
  (`--profile`). Drafting costs 0.4 of a target step per position,
  so the depth matters at every concurrency.
- `h200_design`, `h200_eagle`: the built-in GPU tables (vllm_av/sim/costs.py).

Policies: no speculation and fixed K = 1..7 (`fixed_k<K>`); ours as
shipped (`ours`); ours with the map kept at the identity (`ours_raw_rows`:
each request planned from its stale row as it is, as before the map). Each
cell is the mean over seeds of the throughput over the best fixed K's
(no speculation counted as K = 0). A planning replay, not a measurement
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
sys.path.insert(0, str(REPO))

from vllm_av.core.cost_model import CostModel  # noqa: E402
from vllm_av.sim import StepCost, h200_design, h200_eagle, load_traces, make_policy, simulate  # noqa: E402
from vllm_av.sim.policies import AdaptiveDepthAV  # noqa: E402

K = 7
RESULTS = REPO / "benchmarks/results/cpu_20261205_stale_rows"
DEFAULT_PERIODS = RESULTS / "periods_c1_ours.json"
DEFAULT_PROFILE = RESULTS / "served_profile_cost_table.json"


def cpu_real_pair(periods_path: Path, profile_path: Path) -> CostModel:
    """The CPU's real-pair step costs: a linear fit of the measured periods
    at one request (plain step + per-position drafting), shaped over
    tokens and requests by a start-up profile of the same pair here."""
    data = json.loads(periods_path.read_text())
    rows = [r for r in data["periods"] if r["requests"] == 1 and r["steps"] >= 10]
    depth = np.array([r["depth"] for r in rows], dtype=float)
    ms = np.array([r["period_median_ms"] for r in rows], dtype=float)
    per_position, plain = np.polyfit(depth, ms, 1)
    table = json.loads(profile_path.read_text())
    v_sizes, v_costs = table["verify"]["sizes"], np.array(table["verify"]["costs"])
    d_sizes, d_costs = table["draft"]["sizes"], np.array(table["draft"]["costs"])
    verify = {n: [plain * c / v_costs[0]] for n, c in zip(v_sizes, v_costs)}
    draft = {n: [K * per_position * c / d_costs[0]] for n, c in zip(d_sizes, d_costs)}
    return CostModel.from_samples(verify, draft, graph_sizes=())


class RawRows(AdaptiveDepthAV):
    """Ours with the stale-row map kept at the identity."""

    name = "ours_raw_rows"

    def __init__(self, K, step_cost):
        super().__init__(K, step_cost)
        self.verifier.row_calibration.add = lambda *a, **k: None


def run_cell(trace, cost: CostModel, C: int, seeds, steps: int) -> dict:
    step = StepCost(cost, K)
    names = ["no_spec"] + [f"fixed_k{k}" for k in range(1, K + 1)]
    out = {}
    for name in names:
        out[name] = float(np.mean([simulate(trace, make_policy(name, K, step), step, C, steps, 50,
                                            seed=s).throughput for s in seeds]))
    slopes = []
    for name in ("ours", "ours_raw_rows"):
        r = []
        for s in seeds:
            pol = make_policy("ours_adaptive_depth", K, step) if name == "ours" else RawRows(K, step)
            r.append(simulate(trace, pol, step, C, steps, 50, seed=s).throughput)
            if name == "ours":
                slopes.append(pol.verifier.row_calibration.slope)
        out[name] = float(np.mean(r))
    best_name = max(names, key=out.get)
    return {"tok_s": out, "best_fixed": best_name,
            "over_best_fixed": {k: out[k] / out[best_name] for k in ("ours", "ours_raw_rows")},
            "best_fixed_over_no_spec": out[best_name] / out["no_spec"],
            "fitted_slopes": slopes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", default="cpu_real_pair,h200_design,h200_eagle")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--periods", type=Path, default=DEFAULT_PERIODS,
                    help="step periods by depth (benchmarks/step_periods_by_depth.py --out)")
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE,
                    help="a start-up cost table of the pair (VLLM_AV_COST_TABLE_OUT)")
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "data" / "traces")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tables = {"cpu_real_pair": lambda: cpu_real_pair(args.periods, args.profile),
              "h200_design": lambda: h200_design(K), "h200_eagle": lambda: h200_eagle(K)}
    seeds = range(args.seeds)
    t0 = time.time()
    rows = []
    for cost_name in args.costs.split(","):
        cost = tables[cost_name]()
        for trace in load_traces(args.traces):
            for C in (int(c) for c in args.concurrency.split(",")):
                row = {"cost": cost_name, "dataset": trace.name, "concurrency": C,
                       **run_cell(trace, cost, C, seeds, args.steps)}
                rows.append(row)
                o = row["over_best_fixed"]
                print(f"{cost_name:13s} {trace.name:9s} C={C:<3d} best fixed {row['best_fixed']} "
                      f"({row['best_fixed_over_no_spec']:.3f}x no spec); over it: ours "
                      f"{o['ours']:.3f}, raw rows {o['ours_raw_rows']:.3f}; slope "
                      f"{np.round(row['fitted_slopes'], 2).tolist()}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": "python benchmarks/stale_row_replay.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "seeds": args.seeds,
            "seconds": round(time.time() - t0, 1), "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
