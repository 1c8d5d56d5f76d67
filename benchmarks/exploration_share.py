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

What a depth-0 step costs beyond a plain one (`depth0_step_cost`): per
file (a sitting) and concurrency, the mean over ours' engines of their
batches without an exploring step, less the mean over `--base`'s engines
of all their batches, for the step and each host phase and the GPU span.

What an engine does once early in its life (`first_batch_excess`): per
file, concurrency and engine (every arm), the host time in
`execute_model` over its first timed batch less the median over its later
batches, in ms per batch.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def explores(run: dict) -> bool:
    """Whether a batch held an exploring step: its drafter ran (`propose`
    timed), which at depth 0 only exploration makes it do."""
    return "propose" in run["phases"]


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


def exploring_gpu_span(paths: list[Path], arm: str) -> dict:
    """Per concurrency and engine (runs named `arm...`, side_by_side.py
    --gpu-spans): the mean GPU span per step of the batches with an
    exploring step and of those without, and the difference per batch
    (ms per step times the batch's steps). An engine's batches run the
    same prompts, so the difference is what its exploring steps added."""
    out: dict = {}
    for path in paths:
        data = json.loads(path.read_text())
        for conc, block in data["by_concurrency"].items():
            for name, runs in block["runs"].items():
                if not name.startswith(arm):
                    continue
                spans = {True: [], False: []}
                for run in runs:
                    span = run["phases"].get("gpu_span")
                    if span is not None:
                        spans[explores(run)].append((span["ms_per_step"],
                                                                  run["steps"]))
                if not spans[True] or not spans[False]:
                    continue
                with_, without = (statistics.mean(ms for ms, _ in spans[k]) for k in (True, False))
                steps = statistics.mean(n for _, n in spans[True])
                out.setdefault(conc, {})[f"{path.name}:{name}"] = {
                    "with_ms_per_step": with_, "without_ms_per_step": without,
                    "batches": [len(spans[True]), len(spans[False])],
                    "extra_ms_per_exploring_batch": (with_ - without) * steps}
    return out


DEPTH0_PHASES = ("schedule", "execute_model", "sample_tokens", "update_from_output", "gpu_span")


def _engine_means(runs: list[dict], keep) -> dict | None:
    """One engine's mean ms per step and per phase over its batches that
    `keep` accepts (None without any)."""
    kept = [r for r in runs if keep(r)]
    if not kept:
        return None
    out = {"step": statistics.mean(r["ms_per_step"] for r in kept)}
    for phase in DEPTH0_PHASES:
        vals = [r["phases"][phase]["ms_per_step"] for r in kept if phase in r["phases"]]
        if len(vals) == len(kept):
            out[phase] = statistics.mean(vals)
    return out


def depth0_step_cost(paths: list[Path], arm: str, base: str) -> dict:
    """Per file and concurrency: ours' engines' mean over their batches
    without an exploring step, less `base`'s engines' mean over all their
    batches (ms per step; each engine weighs the same)."""
    out: dict = {}
    for path in paths:
        data = json.loads(path.read_text())
        for conc, block in data["by_concurrency"].items():
            groups: dict[str, list[dict]] = {arm: [], base: []}
            for name, runs in block["runs"].items():
                if name.startswith(arm):
                    means = _engine_means(runs, lambda r: not explores(r))
                    if means is not None:
                        groups[arm].append(means)
                elif name.startswith(base):
                    groups[base].append(_engine_means(runs, lambda r: True))
            if not groups[arm] or not groups[base]:
                continue
            row = {"engines": [len(groups[base]), len(groups[arm])]}
            for key in ("step", *DEPTH0_PHASES):
                if all(key in m for g in groups.values() for m in g):
                    mean = {k: statistics.mean(m[key] for m in g) for k, g in groups.items()}
                    row[key] = {"base_ms": mean[base], "extra_ms": mean[arm] - mean[base]}
            out.setdefault(path.name, {})[conc] = row
    return out


def first_batch_excess(paths: list[Path], phase: str = "execute_model") -> dict:
    """Per file, concurrency and engine: `phase`'s ms over the engine's
    first batch (repeat 0) less the median over its later batches (ms per
    step times the batch's steps). The batches run the same prompts, so
    what the first holds beyond the others happens once."""
    out: dict = {}
    for path in paths:
        data = json.loads(path.read_text())
        for conc, block in data["by_concurrency"].items():
            for name, runs in block["runs"].items():
                totals = {r.get("repeat", i): r["phases"][phase]["ms_per_step"] * r["steps"]
                          for i, r in enumerate(runs) if phase in r["phases"]}
                later = [ms for rep, ms in totals.items() if rep > 0]
                if 0 not in totals or not later:
                    continue
                # Keyed by the whole path: rounds name their runs alike.
                out.setdefault(str(path), {}).setdefault(conc, {})[name] = (
                    totals[0] - statistics.median(later))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--arm", default="ours_served")
    ap.add_argument("--base", default="nospec", help="the plain arm (depth0_step_cost)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {"sources": [str(p) for p in args.paths], "arm": args.arm,
              "by_concurrency": exploration_share(args.paths, args.arm),
              "gpu_span": exploring_gpu_span(args.paths, args.arm),
              "depth0_step_cost": depth0_step_cost(args.paths, args.arm, args.base),
              "first_batch_excess_ms": first_batch_excess(args.paths)}
    for conc, row in result["by_concurrency"].items():
        print(f"C={conc}: {row['exploring_batches']} of {row['batches']} batches explored; "
              f"the drafter's host time {100 * row['mean_share']:.2f}% of ours' step time "
              f"(at most {100 * row['max_share']:.2f}% in one batch)")
    for conc, engines in result["gpu_span"].items():
        for name, row in engines.items():
            print(f"C={conc} {name}: GPU span {row['with_ms_per_step']:.3f} ms per step in "
                  f"batches with an exploring step, {row['without_ms_per_step']:.3f} without: "
                  f"{row['extra_ms_per_exploring_batch']:.1f} ms more per exploring batch")
    for name, concs in result["depth0_step_cost"].items():
        for conc, row in concs.items():
            parts = ", ".join(f"{k} {row[k]['extra_ms']:+.3f}" for k in ("step", *DEPTH0_PHASES)
                              if k in row)
            print(f"C={conc} {name}: ours' batches without an exploring step less "
                  f"{args.base}'s, ms per step ({row['engines'][1]} / {row['engines'][0]} "
                  f"engines; {args.base}'s step {row['step']['base_ms']:.3f}): {parts}")
    for name, concs in result["first_batch_excess_ms"].items():
        for conc, engines in concs.items():
            print(f"C={conc} {name}: execute_model over each engine's first batch less its "
                  "later batches' median, ms: "
                  + ", ".join(f"{e} {ms:+.0f}" for e, ms in engines.items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
