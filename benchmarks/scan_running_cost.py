"""Host time of the scheduling-time depth lookup's scan of the running
requests (a benchmark, not a test): `scan_running`
(vllm_av/vllm/mrv1/scheduled_depth.py, one pass in Python) against
`scan_by_map`, the same scan with map/any over attribute getters, side by
side in one process on the same requests (all decoding, no seeds: the
steady state of a served batch), and `RunningScan`'s kept answer, which
the lookup now uses while no request has joined. Median microseconds per
call over REPEATS blocks of CALLS calls. The map form was tried on the
hot path and measured no faster, so the loop stays for the passes that
still run.

    python benchmarks/scan_running_cost.py [--out benchmarks/results/scan_running_cpu.json]
"""

from __future__ import annotations

import argparse
import operator
import datetime
import json
import os
import platform
import statistics
import sys
import time
from itertools import repeat
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_av.vllm.mrv1.scheduled_depth import RunningScan, scan_running  # noqa: E402

CALLS, REPEATS = 500, 15


_ID = operator.attrgetter("request_id")
_CHUNK = operator.attrgetter("is_prefill_chunk")
_COMPUTED = operator.attrgetter("num_computed_tokens")
_PROMPT_LEN = operator.attrgetter("num_prompt_tokens")
_SEED = operator.attrgetter("sampling_params.seed")


def scan_by_map(running) -> tuple[list, bool, bool]:
    """`scan_running` for a batch with no prompt tokens, iterating in C."""
    prompt = any(map(_CHUNK, running)) or any(
        map(operator.lt, map(_COMPUTED, running), map(_PROMPT_LEN, running)))
    seeded = any(map(operator.is_not, map(_SEED, running), repeat(None)))
    return list(map(_ID, running)), seeded, prompt


def _us_per_call(fn, running) -> float:
    blocks = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn(running)
        blocks.append((time.perf_counter() - t0) / CALLS * 1e6)
    return statistics.median(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="64,256")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.requests.split(",")):
        running = [SimpleNamespace(request_id=f"r{i}", is_prefill_chunk=False,
                                   num_computed_tokens=500, num_prompt_tokens=100,
                                   sampling_params=SimpleNamespace(seed=None))
                   for i in range(n)]
        assert scan_running(running) == scan_by_map(running)
        kept = RunningScan()
        kept(running)  # the pass that primes it
        ids, seeded, prompt = kept(running)
        assert (list(ids), seeded, prompt) == scan_running(running)
        fns = {"loop": scan_running, "map": scan_by_map, "kept": kept}
        # Each order forward and back: none always runs first.
        times = {name: [] for name in fns}
        for name in ("loop", "map", "kept", "kept", "map", "loop"):
            times[name].append(_us_per_call(fns[name], running))
        row = {"requests": n, **{f"{name}_us": statistics.mean(t) for name, t in times.items()}}
        rows.append(row)
        print(f"{n} requests: loop {row['loop_us']:.1f} us, map {row['map_us']:.1f} us, "
              f"kept {row['kept_us']:.2f} us per call")
    result = {"command": " ".join(["python"] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.machine()} {platform.processor()}, "
                         f"{len(os.sched_getaffinity(0))} cpus",
              "calls": CALLS, "repeats": REPEATS, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
