"""Host time of `AdaptiveVerifier` per engine step (a benchmark, not a test).

One synthetic engine step is what the vLLM adapter calls: `forget` (finished
requests), `begin_step`, `observe` (last step's outcomes), `choose_depth`,
`admit`. Features are logit(q_max) ~ N(2, 1.5) per slot; a request accepts
each admitted draft with probability sigmoid(feature) until the first
rejection; each request finishes with probability CHURN per step and a new
one takes its place. CPU, eager selector; median microseconds per step over
STEPS steps after WARMUP.

    python benchmarks/verifier_overhead.py [--label after] [--save-run /tmp/run.npz]

--save-run writes the admitted arrays of every step and the estimator's
coefficients (seed 0, R = 64) so that a change can be checked to keep
behaviour bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vllm_av.core import cost_model
from vllm_av.core.cost_model import CostModel
from vllm_av.core.verifier import AdaptiveVerifier

K = 7
SHAPES = (1, 64, 256)
STEPS = 200
WARMUP = 20
# Probability that a request finishes in a step (mean length 50 steps).
CHURN = 0.02
OUT = Path(__file__).parent / "results" / "verifier_overhead.json"


def _h200_like_cost() -> CostModel:
    # DESIGN 1's H200 1B-model step costs (ms), as in microbench.py.
    verify = {1: [0.86], 64: [0.98], 256: [1.35], 512: [2.16], 1024: [4.0]}
    draft = {1: [0.5], 64: [0.6], 256: [0.9]}
    return CostModel.from_samples(verify, draft, graph_sizes=[1, 64, 256, 512])


def run(R: int, steps: int, seed: int = 0, record: bool = False) -> dict:
    """Drive one verifier for `steps` steps; per-step and per-call times (us)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    v = AdaptiveVerifier(K, _h200_like_cost())
    next_id = R
    ids = [f"r{i}" for i in range(R)]
    admitted = np.zeros(R, dtype=np.int64)
    accepted = np.zeros(R, dtype=np.int64)
    finished: list[str] = []
    times = {k: [] for k in ("step", "observe", "choose_depth", "admit")}
    admitted_log = []
    for _ in range(steps):
        t0 = time.perf_counter()
        v.forget(finished)
        v.begin_step()
        v.observe(ids, admitted, accepted)
        t1 = time.perf_counter()
        d = v.choose_depth(ids, num_sampling=R, num_other_tokens=R)
        t2 = time.perf_counter()
        feats = rng.normal(2.0, 1.5, size=(R, K)).astype(np.float32)
        drafted = np.full(R, d, dtype=np.int64)
        t3 = time.perf_counter()
        if d > 0:
            admitted = v.admit(ids, torch.from_numpy(feats), drafted, R, R)
        else:
            admitted = np.zeros(R, dtype=np.int64)
        t4 = time.perf_counter()
        times["step"].append((t2 - t0 + t4 - t3) * 1e6)
        times["observe"].append((t1 - t0) * 1e6)
        times["choose_depth"].append((t2 - t1) * 1e6)
        times["admit"].append((t4 - t3) * 1e6)
        if record:
            admitted_log.append(np.asarray(admitted).copy())
        # Outcomes of the admitted drafts (verified next step).
        ok = rng.random((R, K)) < 1.0 / (1.0 + np.exp(-feats))
        run_len = np.argmin(np.concatenate([ok, np.zeros((R, 1), bool)], 1), 1)
        accepted = np.minimum(run_len, admitted)
        # Churn: finished requests are forgotten next step, new ids replace them.
        done = rng.random(R) < CHURN
        finished = [rid for rid, f in zip(ids, done) if f]
        for i in np.flatnonzero(done):
            ids[i] = f"r{next_id}"
            next_id += 1
    out = {k: statistics.median(t[WARMUP:]) for k, t in times.items()}
    if record:
        out["admitted"] = np.stack(admitted_log)
        out["coefficients"] = v.estimator.coefficients.numpy().copy()
        out["predicted"] = v.stats.predicted.copy()
        out["observed"] = v.stats.observed.copy()
        out["labelled"] = v.stats.labelled.copy()
    return out


def _dear_drafting_cost() -> CostModel:
    # The served regime with the real pair on the H200: drafting dearer than
    # anything verification could recover, depth 0 skips the drafter.
    cost = CostModel.from_samples({1: [2.5], 256: [3.0], 1024: [6.0]}, {1: [20.0], 256: [35.0]})
    cost.free_zero_depth = True
    return cost


def run_depth_zero(R: int, steps: int, remember: bool, seed: int = 0) -> dict:
    """`choose_depth` where drafting does not pay (depth 0 but for the
    exploration steps), with the depth-0 choice remembered between steps
    (as served) or searched every step (`remember=False`); median us."""
    rng = np.random.default_rng(seed)
    v = AdaptiveVerifier(K, _dear_drafting_cost())
    ids = [f"r{i}" for i in range(R)]
    times, depths = [], []
    for _ in range(steps):
        if not remember:
            v._zero_depth_memo = None
        t0 = time.perf_counter()
        d = v.choose_depth(ids, num_sampling=R, num_other_tokens=R)
        times.append((time.perf_counter() - t0) * 1e6)
        depths.append(d)
        if d:
            feats = torch.from_numpy(rng.normal(2.0, 1.5, size=(R, K)).astype(np.float32))
            admitted = v.admit(ids, feats, np.full(R, d), R, R)
            v.begin_step()
            v.observe(ids, admitted, np.minimum(admitted, 1))
    return {"choose_depth_us": statistics.median(times[WARMUP:]),
            "zero_depth_share": float(np.mean(np.array(depths) == 0))}


def run_depth_zero_timed(R: int, steps: int, seed: int = 0, jitter: float = 0.05) -> dict:
    """`run_depth_zero` as an async engine runs it: every 4th step is timed
    (a plain step measured at 1.3x its profiled cost, lognormal jitter of
    `jitter`) and corrects the cost table; mean us per step of choose_depth
    plus that correction, and how often the cost version moved (each move
    discards the remembered depth-0 choice)."""
    rng = np.random.default_rng(seed)
    v = AdaptiveVerifier(K, _dear_drafting_cost())
    ids = [f"r{i}" for i in range(R)]
    times, bumps, version, zero = [], 0, v.cost.version, 0
    for s in range(steps):
        t0 = time.perf_counter()
        zero += v.choose_depth(ids, num_sampling=R, num_other_tokens=R) == 0
        if s % 4 == 0:
            profiled = float(v.cost.verify.table(R + 1)[R])
            v.observe_verify_time(R, profiled * 1.3 * float(rng.lognormal(0.0, jitter)), plain=True)
        times.append((time.perf_counter() - t0) * 1e6)
        bumps += v.cost.version != version
        version = v.cost.version
    return {"mean_us": statistics.mean(times[WARMUP:]), "version_moves_per_step": bumps / steps,
            "zero_depth_share": zero / steps}


def tensor_ops_per_step(R: int, steps: int = 100) -> dict:
    """Tensor operations the verifier issues per drafting step (top-level
    aten ops under torch.profiler, CPU): on CUDA each one that computes is
    a kernel launch or a copy, host time on every step that drafts."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    run(R, 30)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(R, steps, seed=2)
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                  and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
    # Views (no kernel on any device).
    views = {"aten::select", "aten::slice", "aten::unsqueeze", "aten::reshape", "aten::view",
             "aten::t", "aten::detach", "aten::expand", "aten::squeeze", "aten::lift_fresh",
             "aten::as_strided", "aten::alias", "aten::transpose", "aten::permute"}
    total = sum(ops.values()) / steps
    computing = sum(n for op, n in ops.items() if op not in views) / steps
    return {"ops_per_step": round(total, 1), "non_view_ops_per_step": round(computing, 1),
            "top": {op: round(n / steps, 1) for op, n in ops.most_common(12)}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after", help="key of this run in the JSON (before/after)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--save-run", type=Path, help="npz of a seeded run's admitted + coefficients")
    ap.add_argument("--rescale-tolerance", type=float, default=None,
                    help="run with this cost_model.RESCALE_TOLERANCE (A/B; default: as shipped)")
    args = ap.parse_args(argv)
    if args.rescale_tolerance is not None:
        cost_model.RESCALE_TOLERANCE = args.rescale_tolerance
    torch.set_num_threads(1)  # an engine's host thread; also steadier timings

    if args.save_run:
        rec = run(64, args.steps, seed=0, record=True)
        np.savez(args.save_run, **{k: rec[k] for k in
                                   ("admitted", "coefficients", "predicted", "observed", "labelled")})

    rows = {}
    for R in SHAPES:
        r = run(R, args.steps, seed=1)
        rows[str(R)] = {k: round(x, 1) for k, x in r.items()}
        print(f"R={R:4d} K={K}: step {r['step']:8.1f} us  (observe+forget {r['observe']:7.1f}, "
              f"choose_depth {r['choose_depth']:7.1f}, admit {r['admit']:7.1f})")
    depth_zero = {}
    for R in SHAPES:
        on, off = (run_depth_zero(R, args.steps, remember) for remember in (True, False))
        depth_zero[str(R)] = {"remembered_us": round(on["choose_depth_us"], 1),
                              "searched_us": round(off["choose_depth_us"], 1),
                              "zero_depth_share": on["zero_depth_share"]}
        print(f"R={R:4d} depth 0 ({on['zero_depth_share']:.0%} of steps): choose_depth "
              f"{on['choose_depth_us']:7.1f} us remembered, {off['choose_depth_us']:7.1f} us "
              f"searched every step")

    timed = {}
    for R in SHAPES:
        t = run_depth_zero_timed(R, 4 * args.steps)
        timed[str(R)] = {"mean_us": round(t["mean_us"], 1),
                         "version_moves_per_step": round(t["version_moves_per_step"], 3),
                         "zero_depth_share": round(t["zero_depth_share"], 3)}
        print(f"R={R:4d} depth 0 ({t['zero_depth_share']:.0%} of steps), every 4th step timed: "
              f"{t['mean_us']:7.1f} us per step, cost version moved on "
              f"{t['version_moves_per_step']:.1%} of steps")

    ops = {}
    for R in SHAPES:
        ops[str(R)] = tensor_ops_per_step(R)
        print(f"R={R:4d}: {ops[str(R)]['ops_per_step']:.0f} tensor ops per drafting step, "
              f"{ops[str(R)]['non_view_ops_per_step']:.0f} of them not views")

    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data["what"] = ("median host microseconds per engine step of AdaptiveVerifier "
                    "(forget+begin_step+observe, choose_depth, admit), CPU, K=7, "
                    f"{args.steps} steps, churn {CHURN}/step, torch 1 thread")
    data["command"] = "PYTHONPATH=. python benchmarks/verifier_overhead.py --label <label>"
    data[args.label] = {
        "command": " ".join(["PYTHONPATH=. python benchmarks/verifier_overhead.py",
                             *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} (shared 2-core box)",
        "torch": torch.__version__,
        "per_R": rows,
        # choose_depth where drafting does not pay, depth-0 choice remembered
        # or searched every step (run_depth_zero).
        "depth_zero": depth_zero,
        # ... with every 4th step timed and correcting the costs
        # (run_depth_zero_timed), under this RESCALE_TOLERANCE.
        "depth_zero_timed": timed,
        "rescale_tolerance": cost_model.RESCALE_TOLERANCE,
        # Tensor ops per drafting step (tensor_ops_per_step).
        "tensor_ops": ops,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
