"""Micro-benchmarks of the per-step AV overheads (a benchmark, not a test).

- `size_budget` on the CPU (numpy) over R x K stale scores;
- `select_admitted` on the CPU, eager and compiled;
- on CUDA (when present), `select_admitted` compiled, timed two ways:
  CUDA events around back-to-back launches, and replay of a captured CUDA
  graph (what it costs inside a graphed step).

Targets (DESIGN 6): sizer < 50 us on the CPU, selector < 30 us on the H200,
at 256 requests x K=7.

    python benchmarks/microbench.py [--out benchmarks/results/microbench_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import numpy as np
import torch

from vllm_av.core.budget import size_budget
from vllm_av.core.cost_model import CostModel
from vllm_av.core.selector import select_admitted
from vllm_av.core.survival import survival

K = 7
SHAPES = (1, 64, 256)


def _h200_like_cost() -> CostModel:
    # DESIGN 1's H200 1B-model step costs (ms) as a realistic staircase.
    verify = {1: [0.86], 64: [0.98], 256: [1.35], 512: [2.16], 1024: [4.0]}
    draft = {1: [0.5], 64: [0.6], 256: [0.9]}
    return CostModel.from_samples(verify, draft, graph_sizes=[1, 64, 256, 512])


def _inputs(R: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(R, K, generator=g)
    surv = survival(conf).to(device)
    num_drafted = torch.full((R,), K, dtype=torch.int64, device=device)
    return surv, num_drafted


def _time_cpu(fn, iters: int) -> dict:
    for _ in range(min(50, iters)):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return {"median_us": statistics.median(samples), "p90_us": float(np.percentile(samples, 90))}


def bench_cpu(iters: int) -> dict:
    cost = _h200_like_cost()
    out = {}
    compiled = torch.compile(select_admitted, fullgraph=True, dynamic=False)
    for R in SHAPES:
        rng = np.random.default_rng(R)
        scores = np.cumprod(rng.random((R, K)), axis=1).ravel()
        out[f"size_budget_R{R}"] = _time_cpu(
            lambda: size_budget(scores, R, R, R, cost), iters
        )
        surv, nd = _inputs(R, "cpu")
        B = int(R * K * 0.4)
        out[f"select_eager_cpu_R{R}"] = _time_cpu(lambda: select_admitted(surv, nd, B), iters)
        budget_t = torch.tensor(B)
        compiled(surv, nd, budget_t)  # compile
        out[f"select_compiled_cpu_R{R}"] = _time_cpu(lambda: compiled(surv, nd, budget_t), iters)
    return out


def bench_cuda(iters: int) -> dict:
    out = {}
    compiled = torch.compile(select_admitted, fullgraph=True, dynamic=False)
    for R in SHAPES:
        surv, nd = _inputs(R, "cuda")
        budget_t = torch.tensor(int(R * K * 0.4), device="cuda")
        for _ in range(20):
            compiled(surv, nd, budget_t)
        torch.cuda.synchronize()
        # Events around back-to-back launches (includes launch overhead).
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            compiled(surv, nd, budget_t)
        end.record()
        torch.cuda.synchronize()
        out[f"select_compiled_cuda_R{R}_events"] = {"mean_us": start.elapsed_time(end) * 1e3 / iters}
        # Graph replay: the cost inside a captured step.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                compiled(surv, nd, budget_t)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled(surv, nd, budget_t)
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out[f"select_compiled_cuda_R{R}_graph"] = {"mean_us": start.elapsed_time(end) * 1e3 / iters}
        # Host sync check: nothing in the selector may wait for the device.
        torch.cuda.set_sync_debug_mode("error")
        try:
            compiled(surv, nd, budget_t)
            out[f"select_compiled_cuda_R{R}_no_host_sync"] = True
        except RuntimeError:
            out[f"select_compiled_cuda_R{R}_no_host_sync"] = False
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out["device_name"] = torch.cuda.get_device_name()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "K": K,
        "cpu": bench_cpu(args.iters),
    }
    if torch.cuda.is_available():
        result["cuda"] = bench_cuda(args.iters)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
