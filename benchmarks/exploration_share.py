"""How much of ours' served step time its exploring steps take, from
side-by-side runs (scripts/gpu/side_by_side.py JSON).

    python benchmarks/exploration_share.py benchmarks/results/h200_20261204_round33/side_by_side*.json \
        --out benchmarks/results/h200_20261204_round33/exploration_share.json

Where the policy stays at depth 0 a batch drafts only when it explores
(a full-depth step, the budget deciding what is verified). The drafter's
host time (`propose`, timed in every engine) over the batch's step time is
that exploration's share of the batch; the verification of its drafts is
not in it. Per concurrency, over every batch of every engine of each arm
whose name starts with `--arm`.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def exploration_share(paths: list[Path], arm: str) -> dict:
    rows: dict[str, list[tuple[float, int]]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for conc, block in data["by_concurrency"].items():
            for name, runs in block["runs"].items():
                if not name.startswith(arm):
                    continue
                for run in runs:
                    propose = run["phases"].get("propose", {})
                    share = propose.get("ms_per_step", 0.0) / run["ms_per_step"]
                    rows.setdefault(conc, []).append((share, propose.get("calls", 0)))
    out = {}
    for conc in sorted(rows, key=int):
        shares = [s for s, _ in rows[conc]]
        out[conc] = {"batches": len(shares),
                     "exploring_batches": sum(1 for _, calls in rows[conc] if calls),
                     "mean_share": statistics.mean(shares), "max_share": max(shares)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--arm", default="ours_served")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {"sources": [str(p) for p in args.paths], "arm": args.arm,
              "by_concurrency": exploration_share(args.paths, args.arm)}
    for conc, row in result["by_concurrency"].items():
        print(f"C={conc}: {row['exploring_batches']} of {row['batches']} batches explored; "
              f"the drafter's host time {100 * row['mean_share']:.2f}% of ours' step time "
              f"(at most {100 * row['max_share']:.2f}% in one batch)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
