"""Host work per plain decoding step on Model Runner V2, counted on the CPU.

At depth 0 our V2 path should cost what plain decoding costs; on the H200
the host is the bottleneck below 256 requests (docs/RESULTS.md), so every
tensor op and Triton launch the runner issues per step is time. This
diagnostic runs vLLM 0.32's V2 runner on the CPU (Triton interpreted, as
in scripts/mrv2_cpu_distribution.py) for each arm, counts the torch ops
and Triton launches issued by `execute_model` and `sample_tokens` outside
the model's forward, per decode step, and prints them by call site:

    python scripts/mrv2_cpu_host_ops.py            # plain V2 and ours at depth 0

Arms: `plain` (V2 without speculation), `ours_d0` (our V2 path with a
draft model, depth forced to 0: the steps ours runs when it does not
draft), `ours_d0_fullmeta` (the same with option skip_draft_layer_metadata
off: target steps build the draft layers' attention metadata too),
`ours_d0_noplain` (the same with option plain_zero_draft_steps off: steps
that verify and draft nothing still go through vLLM's speculator
bookkeeping) and `vllm_k1` (vLLM's draft-model speculation, K=1, for scale).
Counts are what the host issues, not what it costs: on the GPU each op is
a launch of a few microseconds and each Triton launch tens.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

ARMS = {
    "plain": {"env": {"VLLM_AV_IMPL": "off"}, "spec": None},
    "ours_d0": {"env": {"VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1",
                        "VLLM_AV_TEST_FIXED_DEPTH": "0"},
                "spec": {"method": "draft_model", "num_speculative_tokens": 4,
                         "enable_adaptive_verification": True}},
    "ours_d0_fullmeta": {"env": {"VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1",
                                 "VLLM_AV_TEST_FIXED_DEPTH": "0",
                                 "VLLM_AV_SKIP_DRAFT_LAYER_METADATA": "0"},
                         "spec": {"method": "draft_model", "num_speculative_tokens": 4,
                                  "enable_adaptive_verification": True}},
    "ours_d0_noplain": {"env": {"VLLM_AV_IMPL": "ours", "VLLM_AV_MRV2": "1",
                                "VLLM_AV_TEST_FIXED_DEPTH": "0",
                                "VLLM_AV_PLAIN_ZERO_DRAFT_STEPS": "0"},
                        "spec": {"method": "draft_model", "num_speculative_tokens": 4,
                                 "enable_adaptive_verification": True}},
    "vllm_k1": {"env": {"VLLM_AV_IMPL": "off"},
                "spec": {"method": "draft_model", "num_speculative_tokens": 1}},
}
PHASES = ("execute_model", "sample_tokens")
SCHEDULER_PHASES = ("schedule", "update_from_output")


class Counter:
    """Torch ops and Triton launches by (phase, call site), while a phase
    runs and no model forward or Triton kernel does; and the phase's host
    time outside those (ms)."""

    def __init__(self) -> None:
        self.phase = None
        self._paused = 0
        self._paused_at = 0.0
        self.paused_ms = 0.0
        self.steps = collections.Counter()
        self.ops = collections.Counter()
        self.host_ms = collections.Counter()

    @property
    def paused(self) -> int:
        return self._paused

    @paused.setter
    def paused(self, value: int) -> None:
        now = time.perf_counter()
        if self._paused == 0 and value > 0:
            self._paused_at = now
        elif self._paused > 0 and value == 0:
            self.paused_ms += (now - self._paused_at) * 1e3
        self._paused = value

    def site(self) -> str:
        # The innermost frame outside torch, triton and this file.
        for frame in reversed(traceback.extract_stack()[:-2]):
            f = frame.filename
            if ("/torch/" in f or "/triton/" in f or f.endswith("mrv2_cpu_host_ops.py")
                    or "/contextlib.py" in f):
                continue
            short = f.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
            return f"{short}:{frame.lineno} {frame.name}"
        return "?"

    def count(self, kind: str, name: str) -> None:
        if self.phase is not None and not self.paused:
            self.ops[(self.phase, kind, name, self.site())] += 1


def install(counter: Counter, count_ops: bool) -> None:
    import contextlib

    import torch
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counter.count("op", str(func.overloadpacket.__name__))
            counter.paused += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                counter.paused -= 1

    run = interp.InterpretedFunction.run

    def counted_run(self, *a, **k):
        counter.count("triton", getattr(self.fn, "__name__", "?"))
        counter.paused += 1
        try:
            return run(self, *a, **k)
        finally:
            counter.paused -= 1

    interp.InterpretedFunction.run = counted_run

    import vllm.v1.worker.gpu.model_runner as mr

    def wrap(name):
        orig = getattr(mr.GPUModelRunner, name)

        def timed(self, *a, **k):
            if not getattr(self, "_host_ops_hooked", False):
                self._host_ops_hooked = True
                for model in {id(m): m for m in _models(self)}.values():
                    model.register_forward_pre_hook(lambda *_: _pause(counter, 1))
                    model.register_forward_hook(lambda *_: _pause(counter, -1))
            counter.phase = name
            counter.steps[name] += 1
            counter.paused_ms = 0.0
            t0 = time.perf_counter()
            try:
                with Ops() if count_ops else contextlib.nullcontext():
                    return orig(self, *a, **k)
            finally:
                counter.host_ms[name] += (time.perf_counter() - t0) * 1e3 - counter.paused_ms
                counter.phase = None

        setattr(mr.GPUModelRunner, name, timed)

    for name in PHASES:
        wrap(name)
    import vllm.v1.core.sched.scheduler as sched

    for name in SCHEDULER_PHASES:  # host only: timed whole
        orig = getattr(sched.Scheduler, name)

        def timed(self, *a, _orig=orig, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _orig(self, *a, **k)
            finally:
                counter.host_ms[_name] += (time.perf_counter() - t0) * 1e3
                counter.steps[_name] += 1

        setattr(sched.Scheduler, name, timed)
    torch.set_num_threads(1)


def _pause(counter: Counter, d: int) -> None:
    counter.paused += d


def _models(runner):
    out = [runner.model]
    draft = getattr(getattr(runner, "speculator", None), "model", None)
    if draft is not None:
        out.append(draft)
    return out


def engine(cfg: dict) -> None:
    from mrv2_cpu_distribution import _lift_refusals, capture_managers, start_engine

    _lift_refusals()
    counter = Counter()
    if not cfg.get("profile"):  # the wrappers would weigh on the profile
        install(counter, count_ops=cfg["count_ops"])
    managers = capture_managers()
    from vllm import SamplingParams

    spec = dict(cfg["spec"], model=cfg["draft"]) if cfg["spec"] else None
    llm = start_engine(cfg["target"], spec, managers)
    params = SamplingParams(temperature=1.0, max_tokens=cfg["tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 50 for j in range(12)]}
               for i in range(cfg["requests"])]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: first-call work
    counter.ops.clear()
    counter.steps.clear()
    counter.host_ms.clear()
    if cfg.get("profile"):
        import cProfile

        prof = cProfile.Profile()
        prof.runcall(llm.generate, prompts, params, use_tqdm=False)
        prof.dump_stats(cfg["profile"])
        print("RESULT " + json.dumps({"steps": {}, "rows": []}))
        return
    llm.generate(prompts, params, use_tqdm=False)
    steps = counter.steps["sample_tokens"] or 1
    rows = [{"phase": p, "kind": k, "name": n, "site": s, "per_step": c / steps}
            for (p, k, n, s), c in counter.ops.items()]
    host = {p: counter.host_ms[p] / max(counter.steps[p], 1)
            for p in PHASES + SCHEDULER_PHASES}
    print("RESULT " + json.dumps({"steps": dict(counter.steps), "rows": rows,
                                  "host_ms_per_step": host}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="plain,ours_d0")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", help="write the counts here (JSON)")
    ap.add_argument("--count-ops", action="store_true",
                    help="count torch ops and Triton launches by call site (slows the host "
                         "times it also prints)")
    ap.add_argument("--draft-head-size", type=int, default=64,
                    help="the draft's attention head size (the target's is 32): a size of "
                         "its own gives the draft attention groups of their own, as the "
                         "real pair's 64 against 128 does")
    ap.add_argument("--repeats", type=int, default=1, help="engines per arm, arms alternated")
    ap.add_argument("--profile", help="write each arm's cProfile stats to PROFILE.<arm> "
                                      "instead")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine(json.loads(args.engine))
        return

    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "vllm")]
    from mrv2_cpu_distribution import engine_env, run_engine_process
    from tiny_models import build_draft_with_head_size, build_tiny_models

    from vllm_av.core.cost_model import CostModel

    work = Path(tempfile.mkdtemp(prefix="host_ops_"))
    models = build_tiny_models(work / "models")
    if args.draft_head_size != 32:
        models = build_draft_with_head_size(models, args.draft_head_size)
    # No graphs on the CPU, so no start-up profile: a flat table (the depth
    # is forced; the table only lets the policy start).
    costs = work / "costs.json"
    costs.write_text(CostModel.from_samples({1: [10.0], 512: [10.0]}, {1: [1.0]}).to_json())
    results: dict = {}
    arms = args.arms.split(",")
    for arm in arms:
        if arm not in ARMS:
            sys.exit(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    for rep, arm in ((r, a) for r in range(args.repeats) for a in arms):
        env = engine_env(costs, **ARMS[arm]["env"])
        cfg = {"target": str(models.target), "draft": str(models.draft),
               "spec": ARMS[arm]["spec"], "requests": args.requests, "tokens": args.tokens,
               "count_ops": args.count_ops,
               "profile": f"{args.profile}.{arm}" if args.profile else None}
        print(f"[host-ops] {arm}: engine log in {work}/{arm}.log", flush=True)
        _, res = run_engine_process(__file__, cfg, env, work / f"{arm}.log", f"host-ops {arm}")
        print(f"[host-ops] {arm} (engine {rep + 1}): host ms per step outside forwards and "
              f"Triton: " + ", ".join(f"{p} {v:.3f}" for p, v in
                                      res.get("host_ms_per_step", {}).items()), flush=True)
        results.setdefault(arm, []).append(res)
    summary = {arm: {p: statistics.median(r["host_ms_per_step"][p] for r in runs)
                     for p in PHASES + SCHEDULER_PHASES}
               for arm, runs in results.items() if runs[0].get("host_ms_per_step")}
    print("\nhost ms per step (median over engines): " + json.dumps(summary))
    for arm, runs in results.items():
        res = runs[-1]
        if not args.count_ops:
            continue
        rows = sorted(res["rows"], key=lambda r: (r["phase"], -r["per_step"]))
        print(f"\n== {arm}: {res['steps']}")
        for phase in PHASES:
            mine = [r for r in rows if r["phase"] == phase]
            ops = sum(r["per_step"] for r in mine if r["kind"] == "op")
            tri = sum(r["per_step"] for r in mine if r["kind"] == "triton")
            print(f"  {phase}: {ops:.1f} torch ops, {tri:.1f} Triton launches per step")
            by_site = collections.Counter()
            for r in mine:
                by_site[(r["kind"], r["site"])] += r["per_step"]
            for (kind, site), n in by_site.most_common(40):
                print(f"    {n:6.2f} {kind:6s} {site}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "host_ms_per_step": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
