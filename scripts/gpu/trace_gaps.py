"""What the host was doing while the GPU waited, from a profiler timeline.

Reads a Chrome trace written by `scripts/gpu/step_breakdown.py --trace`
(torch.profiler; plain or gzipped JSON) and reports:

- the GPU's busy time (kernels, copies and memsets, overlaps counted once)
  and its idle time between the first and the last device event;
- the idle gaps longer than `--min-gap-us`, how many and how long;
- for every Python function on the host (and CUDA runtime call: a
  synchronize shows there), how much of the GPU's idle time passed inside
  it (nested functions each count their own overlap, so a caller's figure
  includes its callees'): the functions at the top of that list are where
  an engine whose host sets the pace spends the time the GPU waits;
- the same by self time: the idle time inside a function but outside the
  functions it called, which ranks the leaves where that time goes.

Only threads that made a CUDA runtime call count: the profiler also
records the other threads (a progress bar's monitor, the profiler's own
exit), which sleep through the whole batch.

    python scripts/gpu/trace_gaps.py trace_ours_async.json.gz [--top 40] [--out gaps.json]

Compare two arms' reports (plain V1 against ours) function by function.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

# Trace categories of work on the device.
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# Trace categories of host work attributed (Python functions need the
# profile taken with_stack=True, as step_breakdown.py does).
HOST_CATEGORIES = ("python_function", "cuda_runtime")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering `spans`."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def idle_gaps(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals between consecutive busy intervals."""
    return [(b0, a1) for (_, b0), (a1, _) in zip(busy, busy[1:]) if a1 > b0]


def overlap_with(gaps: list[tuple[float, float]], a: float, b: float, starts: list[float]) -> float:
    """Total overlap of [a, b) with the sorted disjoint `gaps` (`starts`:
    their start times)."""
    total = 0.0
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    while i < len(gaps) and gaps[i][0] < b:
        lo, hi = max(a, gaps[i][0]), min(b, gaps[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def analyse(events: list[dict], min_gap_us: float = 20.0, top: int = 40,
            host_categories=HOST_CATEGORIES) -> dict:
    device = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
              if e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        raise ValueError("no device events in the trace (was it profiled with CUDA activity?)")
    busy = union(device)
    gaps = idle_gaps(busy)
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    long_gaps = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    starts = [g[0] for g in gaps]
    launching = {(e.get("pid"), e.get("tid")) for e in events if e.get("cat") == "cuda_runtime"}
    inside: dict[tuple[str, str], float] = defaultdict(float)
    self_inside: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    host = sorted((e for e in events if e.get("cat") in host_categories
                   and (e.get("pid"), e.get("tid")) in launching),
                  key=lambda e: (e.get("pid"), e.get("tid"), float(e["ts"]), -float(e["dur"])))
    stack: list[tuple[tuple, float, tuple[str, str]]] = []  # (thread, end, key) of open calls
    for e in host:
        a, thread = float(e["ts"]), (e.get("pid"), e.get("tid"))
        b = a + float(e["dur"])
        while stack and (stack[-1][0] != thread or stack[-1][1] <= a):
            stack.pop()
        o = overlap_with(gaps, a, b, starts)
        key = (e["cat"], e["name"])
        if stack:  # the caller's self time excludes what passed in this call
            self_inside[stack[-1][2]] -= o
        self_inside[key] += o
        stack.append((thread, b, key))
        if o > 0:
            inside[key] += o
            calls[key] += 1
    ranked = sorted(inside.items(), key=lambda kv: -kv[1])[:top]
    return {
        "span_ms": span / 1e3,
        "gpu_busy_ms": busy_us / 1e3,
        "gpu_idle_ms": (span - busy_us) / 1e3,
        "gaps": len(gaps),
        "long_gaps": len(long_gaps),
        "long_gap_ms": sum(b - a for a, b in long_gaps) / 1e3,
        "min_gap_us": min_gap_us,
        "host_functions_during_idle": [
            {"function": name, "category": cat, "idle_ms_inside": us / 1e3,
             "calls": calls[(cat, name)]}
            for (cat, name), us in ranked
        ],
        "host_functions_by_self_idle": [
            {"function": name, "category": cat, "self_idle_ms": us / 1e3,
             "calls": calls[(cat, name)]}
            for (cat, name), us in sorted(self_inside.items(), key=lambda kv: -kv[1])[:top]
            if us > 0
        ],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    report = analyse(load_events(args.trace), args.min_gap_us, args.top)
    print(f"{args.trace}: GPU busy {report['gpu_busy_ms']:.1f} ms, idle "
          f"{report['gpu_idle_ms']:.1f} ms of {report['span_ms']:.1f} ms; {report['gaps']} gaps, "
          f"{report['long_gaps']} of >= {args.min_gap_us:.0f} us ({report['long_gap_ms']:.1f} ms)")
    print("GPU idle time inside host functions (ms, calls):")
    for row in report["host_functions_during_idle"]:
        print(f"  {row['idle_ms_inside']:8.2f}  {row['calls']:6d}  {row['function']}"
              + ("  (CUDA runtime)" if row["category"] == "cuda_runtime" else ""))
    print("... by self time (inside the function, outside its callees):")
    for row in report["host_functions_by_self_idle"]:
        print(f"  {row['self_idle_ms']:8.2f}  {row['calls']:6d}  {row['function']}"
              + ("  (CUDA runtime)" if row["category"] == "cuda_runtime" else ""))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
