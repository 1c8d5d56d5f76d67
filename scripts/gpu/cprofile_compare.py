"""Compare two groups of engines' cProfile files (side_by_side.py --cprofile).

    python scripts/gpu/cprofile_compare.py \
        benchmarks/results/<round>/cprofile_nospec{,_twin,_twin2}_c64.pstats \
        --other benchmarks/results/<round>/cprofile_ours_served{,_twin,_twin2}_c64.pstats

Each group's files are pooled (their steps summed). Own time per step is
compared two ways:
  * functions that only the other group calls, with their own time per
    step: work that group adds outright;
  * every function's own time per step, the base group's scaled by the
    groups' speed on vLLM's per-request output code (`REFERENCE`: the same
    work in both groups at a step that verifies no draft), so that one
    engine process running all its Python slower does not read as extra
    work in every function.
Under Python 3.12 cProfile records every thread of the process, so the
writer thread's calls appear too (their callers are not reliable).
"""
from __future__ import annotations

import argparse
import json
import pstats
import statistics
import sys

# vLLM functions whose work per step is the same with or without a
# speculative configuration at depth 0: the output of each request.
REFERENCE = ("update_from_output", "_update_request_with_output", "check_stop",
             "append_output_token_ids")


def load(paths: list[str]) -> tuple[dict, int]:
    """Pooled stats of `paths` and their steps (calls of the scheduler's
    `schedule`)."""
    stats = pstats.Stats(paths[0])
    for p in paths[1:]:
        stats.add(p)
    table = stats.stats
    steps = sum(v[1] for k, v in table.items()
                if k[2] == "schedule" and k[0].endswith("sched/scheduler.py"))
    if steps == 0:
        raise SystemExit(f"{paths}: no calls of the scheduler's schedule")
    return table, steps


def label(key) -> str:
    path, line, name = key
    return f"{path.split('site-packages/')[-1]}:{line} {name}"


def plain_key(key) -> tuple:
    """A function's key without what differs between processes (the
    site-packages folder; builtins carry an address)."""
    path, line, name = key
    return (path.split("site-packages/")[-1], line, name.split(" at 0x")[0])


def speed_factor(base: dict, base_steps: int, other: dict, other_steps: int) -> float:
    """Other's own time per step over base's on the REFERENCE functions."""
    def total(table, steps):
        return sum(v[2] for k, v in table.items()
                   if k[2] in REFERENCE and "vllm/v1/" in k[0]) / steps
    b = total(base, base_steps)
    return total(other, other_steps) / b if b > 0 else 1.0


def equal_work_ratio(base_rows: dict, other_rows: dict, min_us: float = 3.0,
                     calls_tolerance: float = 0.02) -> dict:
    """Other's own time over base's, function by function, over the
    functions both groups call equally often per step (within
    `calls_tolerance`) with at least `min_us` us of own time per step in
    the base: the same work, so their ratio is how fast each group's
    processes ran it. The median and the time-weighted ratio, and how many
    functions."""
    ratios, base_us, other_us = [], 0.0, 0.0
    for k, (calls, own) in base_rows.items():
        o = other_rows.get(k)
        if o is None or calls < 0.5 or own * 1e6 < min_us:
            continue
        if abs(o[0] - calls) > calls_tolerance * calls:
            continue
        ratios.append(o[1] / own)
        base_us += own
        other_us += o[1]
    if not ratios:
        return {"functions": 0, "median": 1.0, "weighted": 1.0}
    return {"functions": len(ratios), "median": statistics.median(ratios),
            "weighted": other_us / base_us}


def per_function(table: dict, steps: int) -> tuple[dict, dict]:
    """plain_key -> [calls, own seconds] per step (builtins of several
    addresses pooled), and plain_key -> a label."""
    rows: dict = {}
    names: dict = {}
    for k, v in table.items():
        row = rows.setdefault(plain_key(k), [0.0, 0.0])
        row[0] += v[1] / steps
        row[1] += v[2] / steps
        names[plain_key(k)] = label(k)
    return rows, names


def compare(base_paths: list[str], other_paths: list[str], top: int = 30) -> dict:
    base, bs = load(base_paths)
    other, os_ = load(other_paths)
    factor = speed_factor(base, bs, other, os_)
    base_rows, base_names = per_function(base, bs)
    other_rows, names = per_function(other, os_)
    names = {**base_names, **names}
    only = sorted(((row[1] * 1e6, row[0], names[k]) for k, row in other_rows.items()
                   if k not in base_rows), reverse=True)
    zero = [0.0, 0.0]
    excess = sorted((((other_rows.get(k, zero)[1] - factor * base_rows.get(k, zero)[1]) * 1e6,
                      names[k]) for k in set(base_rows) | set(other_rows)), reverse=True)
    return {
        "steps": [bs, os_], "speed_factor": factor,
        "equal_work": equal_work_ratio(base_rows, other_rows),
        "own_us_per_step": [sum(v[2] for v in base.values()) / bs * 1e6,
                            sum(v[2] for v in other.values()) / os_ * 1e6],
        "only_other_us_per_step": sum(r[0] for r in only),
        "only_other": [{"us_per_step": u, "calls_per_step": c, "function": f}
                       for u, c, f in only[:top]],
        "scaled_excess": [{"us_per_step": u, "function": f} for u, f in excess[:top]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", nargs="+", help="the base group's .pstats files")
    ap.add_argument("--other", nargs="+", required=True, help="the other group's .pstats files")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None, help="write the comparison as JSON")
    args = ap.parse_args()
    out = compare(args.base, args.other, args.top)
    if args.out:  # first: a reader that closes the pipe early must not lose it
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"steps {out['steps'][0]} / {out['steps'][1]}; own time per step "
          f"{out['own_us_per_step'][0]:.0f} / {out['own_us_per_step'][1]:.0f} us under the "
          f"profiler; speed factor on vLLM's output code {out['speed_factor']:.3f}")
    eq = out["equal_work"]
    print(f"the same work (functions called equally often, {eq['functions']} of them): other's "
          f"own time over base's, median {eq['median']:.3f}, time-weighted {eq['weighted']:.3f}")
    print(f"functions only the other group calls: {out['only_other_us_per_step']:.1f} us "
          "of own time per step")
    for r in out["only_other"]:
        print(f"  {r['us_per_step']:7.1f} us  {r['calls_per_step']:6.2f} calls  {r['function']}")
    print("own time per step over the base's scaled by the speed factor:")
    for r in out["scaled_excess"]:
        print(f"  {r['us_per_step']:+7.1f} us  {r['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
