"""Does a process run all its Python slower once it has called a
torch.compile'd function?

Ours' engine processes compile and call the selector
(`vllm_av.core.selector.compiled_select_admitted`, warmed at start-up and
run at every drafting step) where plain V2's never enter TorchDynamo at
run time, and the thirtieth round found vLLM's own per-request code 3-6%
slower in ours' engines. This times a fixed pure-Python workload (the one
`scripts/gpu/side_by_side.py --python-speed` runs in each engine) in one
process before and after each stage: importing TorchDynamo, calling a
function compiled with the `eager` backend, calling the compiled selector
(Inductor, on CUDA where there is one). `--control` runs the same stages
without compiling anything, to show the drift between stages on an idle
machine. Core only (no vLLM).

    python benchmarks/python_speed_after_compile.py --out /tmp/x.json
    python benchmarks/python_speed_after_compile.py --control --out /tmp/y.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

from side_by_side import frame_hooks, workload_times  # noqa: E402  (stdlib-only at import)


def speed(runs: int, n: int) -> dict:
    times = workload_times(runs, n)
    return {"median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=41)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--control", action="store_true", help="the same stages, compiling nothing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stages = []

    def stage(name: str) -> None:
        row = {"stage": name, **speed(args.runs, args.n), **frame_hooks()}
        stages.append(row)
        print(f"{name:32s} {row['median_ms']:.3f} ms (min {row['min_ms']:.3f})", flush=True)

    stage("start")
    import torch

    stage("torch imported")
    import torch._dynamo  # noqa: F401

    stage("dynamo imported")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.control:
        fn = torch.compile(lambda x: (x * 2).sum(), backend="eager", fullgraph=True)
        fn(torch.ones(8)), fn(torch.ones(8))
    stage("eager-backend compile called" if not args.control else "(nothing compiled) 1")
    if not args.control:
        from vllm_av.core.selector import compiled_select_admitted

        select = compiled_select_admitted()
        R, K = 256, 7
        drafted = torch.full((R,), K, dtype=torch.int32, device=device)
        for _ in range(2):
            select(torch.rand(R, K, device=device), drafted, 64)
        if device == "cuda":
            torch.cuda.synchronize()
    stage("selector compiled and called" if not args.control else "(nothing compiled) 2")
    stage("again")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(["python"] + sys.argv),
              "python": sys.version.split()[0], "torch": torch.__version__, "device": device,
              "machine": platform.machine(), "control": args.control, "stages": stages}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
