"""Throughput of a sweep's cells read per request, beside the cells' own.

A cell's output tok/s is its tokens over its wall time, so the last
requests to finish weigh on it. Read per request instead: output tokens
over the summed request latencies, times the concurrency (what C requests
kept busy all the time would produce). For arms with our metrics, also the
engine steps of the cell and the mean wall time per step.

    python benchmarks/per_request_throughput.py \\
        benchmarks/results/h200_20261130_round15/h200_focus4 --arms nospec,ours_v2g \\
        --out benchmarks/results/h200_20261130_round15/per_request_throughput.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def cell(path: Path) -> dict:
    d = json.loads(path.read_text())
    c = int(d["max_concurrency"])
    out = {
        "cell_tok_s": round(d["output_throughput"], 1),
        "per_request_tok_s": round(sum(d["output_lens"]) / sum(d["latencies"]) * c, 1),
        "median_latency_s": round(sorted(d["latencies"])[len(d["latencies"]) // 2], 3),
        "duration_s": round(d["duration"], 3),
    }
    steps = d.get("sweep", {}).get("metrics_delta", {}).get("vllm_av:depth_steps_total")
    if steps:
        out["steps"] = int(steps)
        out["ms_per_step"] = round(d["duration"] / steps * 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--arms", required=True, help="comma list; the first is the reference")
    ap.add_argument("--concurrency", default="1,16,32,64,128,256")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    arms = args.arms.split(",")
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        row = {"C": c, **{a: cell(args.run_dir / f"{a}_c{c}.json") for a in arms}}
        ref = row[arms[0]]
        for a in arms[1:]:
            row[f"{a}/{arms[0]}"] = {
                k: round(row[a][k] / ref[k], 3) for k in ("cell_tok_s", "per_request_tok_s")}
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps({"run_dir": str(args.run_dir), "arms": arms,
                                        "command": "python benchmarks/per_request_throughput.py",
                                        "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
