"""What an engine did once: a first batch's cProfile less a later batch's of
the same engine (side_by_side.py --cprofile-first C --cprofile C).

    python scripts/gpu/cprofile_first_batch.py \
        benchmarks/results/<round>/cprofile_first_ours_served_c1.pstats \
        benchmarks/results/<round>/cprofile_ours_served_c1.pstats --top 25 \
        --named _admit_on_device --named index_select

Totals over each batch, not per step: a one-time cost is one call. Rows
are the functions whose own time, then whose cumulative time, grew most
from the later batch to the first, with their call counts in each. Under
Python 3.12 cProfile records every thread, and a call entered from C (a
compiled frame, a Dynamo trace) has no reliable caller: read the
cumulative rows as where time went, not as a call tree. `--named` adds,
for each function whose name holds one of the given strings, its calls,
own and cumulative ms in each batch (what a fix was to remove, say).
"""
from __future__ import annotations

import argparse
import json
import pstats


def totals(path: str) -> dict[str, list]:
    """function -> [calls, own s, cumulative s], summed over same-named entries."""
    out: dict[str, list] = {}
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(path).stats.items():
        key = f"{file.split('site-packages/')[-1].split('/site/')[-1]}:{line}({name})"
        row = out.setdefault(key, [0, 0.0, 0.0])
        row[0] += calls
        row[1] += own
        row[2] += cum
    return out


def grown(first: dict, later: dict, column: int, top: int) -> list[dict]:
    zero = [0, 0.0, 0.0]
    keys = sorted(set(first) | set(later),
                  key=lambda k: later.get(k, zero)[column] - first.get(k, zero)[column])
    return [{"function": k, "ms_more": round(1e3 * (first.get(k, zero)[column]
                                                  - later.get(k, zero)[column]), 3),
             "calls_first": first.get(k, zero)[0], "calls_later": later.get(k, zero)[0]}
            for k in keys[:top]]


def named(first: dict, later: dict, needles: list[str]) -> list[dict]:
    """Every function whose name holds one of `needles`, in both batches."""
    rows = []
    for k in sorted(k for k in set(first) | set(later) if any(n in k for n in needles)):
        row = {"function": k}
        for side, batch in (("first", first), ("later", later)):
            calls, own, cum = batch.get(k, [0, 0.0, 0.0])
            row |= {f"calls_{side}": calls, f"own_ms_{side}": round(1e3 * own, 3),
                    f"cum_ms_{side}": round(1e3 * cum, 3)}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first", help="the first batch's .pstats")
    ap.add_argument("later", help="a later batch's .pstats of the same engine")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--named", action="append", default=[],
                    help="also list functions whose name holds this (repeatable)")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args = ap.parse_args()
    first, later = totals(args.first), totals(args.later)
    result = {"first": args.first, "later": args.later,
              "own": grown(first, later, 1, args.top),
              "cumulative": grown(first, later, 2, args.top)}
    for column in ("own", "cumulative"):
        print(f"== {column} time, first batch less later batch (ms); calls first/later")
        for r in result[column]:
            print(f"{r['ms_more']:+10.2f}  {r['calls_first']:>7}/{r['calls_later']:<7} {r['function']}")
    if args.named:
        result["named"] = named(first, later, args.named)
        print("== named: calls, own ms, cumulative ms; first batch | later batch")
        for r in result["named"]:
            print(f"{r['calls_first']:>7} {r['own_ms_first']:9.2f} {r['cum_ms_first']:9.2f} | "
                  f"{r['calls_later']:>7} {r['own_ms_later']:9.2f} {r['cum_ms_later']:9.2f}  "
                  f"{r['function']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
