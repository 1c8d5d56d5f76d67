"""Host time of our per-step work on a Model Runner V2 drafting step (CPU).

    python benchmarks/mrv2_drafting_host.py --out benchmarks/results/mrv2_drafting_host_cpu.json

What a step of `ours_v2g` that drafts adds on the host beside vLLM's own
work, per call site, for 1..256 decoding requests:
  schedule   the scheduler's depth choice through `DepthFromVerifier`
             (the loop over running requests, then `AVManager.choose_depth`
             over confidences that changed since the last step);
  budget     `get_num_tokens` (stale scores, the budget) and `compact_batch`;
  layout     `reallocate_drafts` when every draft is admitted (the host
             layout and its copy; on CPU tensors here);
  record     `record_confidences` (CPU tensors: no copy stream).
Median over repeated steps. Per size also, apart: the depth search alone
(`best_depth`, every depth from one sort) against a budget search at each
depth (`best_budget` per depth, the search it replaced, without the bound
that skipped some), and the metrics snapshot written in place against
handed to the background writer. `--metrics-in-place` writes the steps'
own snapshots in place too. The device-side costs of the same calls on the
H200 are in `mrv2_host_costs_h200.json` (benchmarks/mrv2_host_costs.py);
this is the host's Python and numpy, which under async scheduling is on the
critical path once the host's step is longer than the GPU's.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

import vllm_av.vllm.metrics as metrics
from benchmarks.mrv2_depth_overhead import K, cpu_manager
from vllm_av.core.budget import best_budget, best_depth
from vllm_av.vllm.mrv1.scheduled_depth import DepthFromVerifier, register_local_verifier

PHASES = ("schedule", "budget", "layout", "record")


def _manager(R: int, metrics_dir: str):
    m = cpu_manager(R, metrics_dir)
    # Drafting pays (cheap drafter, flat verification): the policy drafts.
    m.set_cost_curves([(1, [0.2]), (256, [0.4])], [(1, [2.0]), (2048, [2.5])])
    return m


def _scheduler(R: int):
    running = [SimpleNamespace(request_id=f"r{i}", is_prefill_chunk=False, num_computed_tokens=100,
                               num_prompt_tokens=10, sampling_params=SimpleNamespace(seed=None))
               for i in range(R)]
    return SimpleNamespace(num_spec_tokens=K, running=running)


def time_steps(R: int, steps: int, metrics_dir: str, seed: int = 0) -> dict:
    m = _manager(R, metrics_dir)
    register_local_verifier(m)
    lookup = DepthFromVerifier(_scheduler(R))
    ids = [f"r{i}" for i in range(R)]
    idx = torch.arange(R)
    batch = SimpleNamespace(num_reqs=R, idx_mapping=idx, idx_mapping_np=np.arange(R))
    g = torch.Generator().manual_seed(seed)
    times = {p: [] for p in PHASES}
    depths = []
    for _ in range(steps):
        t0 = time.perf_counter()
        d = lookup[R]
        t1 = time.perf_counter()
        depth = max(d, 1)  # time a drafting step whatever was chosen
        per_req = {r: 1 + depth for r in ids}
        draft_tokens = {r: [0] * depth for r in ids}
        m.get_num_tokens(per_req, draft_tokens)
        nd = np.full(R, depth, dtype=np.int32)
        sched = nd + 1
        m.compact_batch(nd, sched, np.concatenate([[0], np.cumsum(sched)]).astype(np.int32))
        t2 = time.perf_counter()
        m.reallocate_drafts(ids, idx)
        t3 = time.perf_counter()
        m.record_confidences(torch.rand(R, K, generator=g), batch)
        t4 = time.perf_counter()
        for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[p].append(dt)
        depths.append(d)
    register_local_verifier(None)
    row = {"R": R, "steps": steps, "mean_depth_chosen": float(np.mean(depths))}
    for p in PHASES:
        row[f"{p}_us_median"] = 1e6 * float(np.median(times[p]))
    total = np.sum([times[p] for p in PHASES], axis=0)
    row["total_us_median"] = 1e6 * float(np.median(total))
    # The mean carries what comes every few steps (the metrics snapshot).
    row["total_us_mean"] = 1e6 * float(np.mean(total))
    row["total_us_p99"] = 1e6 * float(np.percentile(total, 99))
    return row


def _median_us(fn, reps: int = 300) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times))


def time_parts(R: int, metrics_dir: str, seed: int = 0) -> dict:
    """The depth search and the snapshot write, each alone."""
    m = _manager(R, metrics_dir)
    rng = np.random.default_rng(seed)
    acc = rng.uniform(0.3, 0.9, (R, 1))
    rows = np.cumprod(np.broadcast_to(acc, (R, K)), axis=1).astype(np.float32)
    cost = m.cost
    draft = [float(cost.at_depth(d, K).draft_cost(R)) for d in range(K + 1)]

    def per_depth():
        for d in range(K + 1):
            best_budget(rows[:, :d].ravel(), R, R, R, cost.at_depth(d, K))

    view = m._snapshot_view()
    in_place = _median_us(lambda: metrics.write_snapshot(metrics_dir, view))
    handed = _median_us(lambda: metrics.write_snapshot(metrics_dir, view, background=True))
    metrics.flush_snapshots()
    return {"search_one_sort_us": _median_us(lambda: best_depth(rows, R, R, draft, cost)),
            "search_per_depth_us": _median_us(per_depth),
            "snapshot_in_place_us": in_place, "snapshot_handed_us": handed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,16,64,256")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default=None)
    p.add_argument("--metrics-in-place", action="store_true",
                   help="the steps' snapshots written on the engine's thread (as before "
                        "the background writer)")
    args = p.parse_args()
    if args.metrics_in_place:
        write = metrics.write_snapshot
        metrics.write_snapshot = lambda *a, background=False, **k: write(*a, **k)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for R in (int(x) for x in args.sizes.split(",")):
            row = time_steps(R, args.steps, tmp)
            row.update(time_parts(R, tmp))
            rows.append(row)
            print(f"R={R}: " + ", ".join(f"{p} {row[p + '_us_median']:.0f} us" for p in PHASES)
                  + f"; total {row['total_us_median']:.0f} us (mean {row['total_us_mean']:.0f}, "
                  f"p99 {row['total_us_p99']:.0f}; mean depth chosen "
                  f"{row['mean_depth_chosen']:.2f}); search {row['search_one_sort_us']:.0f} us "
                  f"(per depth {row['search_per_depth_us']:.0f}); snapshot "
                  f"{row['snapshot_in_place_us']:.0f} us in place, "
                  f"{row['snapshot_handed_us']:.0f} handed over")
    command = "python benchmarks/mrv2_drafting_host.py" + (
        " --metrics-in-place" if args.metrics_in_place else "")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "command": command, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
