"""Host time per step of vLLM's scheduler with and without speculation.

The scheduler (vllm/v1/core/sched/scheduler.py) and the KV cache manager
are host Python that every runner shares, so what they cost with and
without a speculative config can be measured on the CPU. One in-process
engine per arm and concurrency on the tiny random pair of the tests
(tests/vllm/tiny_models.py), Model Runner V1, greedy, every request running
to --max-tokens, as benchmarks/depth_zero_overhead.py: `plain` (no
speculation) and `ours_depth0` (our AV, draft model, K=7, with a cost
table that makes drafting prohibitive, so every step runs at depth 0).

`Scheduler.schedule`, `Scheduler.update_from_output`,
`KVCacheManager.allocate_slots` (and a few of their parts) are wrapped with
time.perf_counter timers, no synchronisation, before the engine is built.
Per step = per `schedule` call of the timed batch (one engine step each).
Also records the engine's KV cache groups, the scheduler's
num_lookahead_tokens, the num_lookahead_tokens / num_new_tokens each
allocate_slots call is asked for, and the draft tokens scheduled per step.

    python benchmarks/scheduler_host_costs.py --async-scheduling \
        --out benchmarks/results/scheduler_host_costs_cpu.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO / "benchmarks"))
from method_spec import resolve_method  # noqa: E402
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# name -> "module:Class.method"; the first is the step.
TIMED = {
    "schedule": "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "update_from_output": "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "allocate_slots": "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
    # parts (nested inside the two above)
    "make_cached_request_data": "vllm.v1.core.sched.scheduler:Scheduler._make_cached_request_data",
    "update_after_schedule": "vllm.v1.core.sched.scheduler:Scheduler._update_after_schedule",
    "async_update_after_schedule":
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
    # (per-request calls other than allocate_slots are left unwrapped: a
    # wrapper per request would weigh on the step it measures)
    "update_draft_token_ids": "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
    "update_draft_token_ids_in_output":
        "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids_in_output",
    # ours: the depth chosen at scheduling time (vllm_av/vllm/mrv1/scheduled_depth.py)
    "av_depth_lookup": "vllm_av.vllm.mrv1.scheduled_depth:DepthFromVerifier.__getitem__",
    # runner side, for the record (host wall, no synchronisation needed on the CPU)
    "execute_model": "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
    "sample_tokens": "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
    "propose_draft_token_ids":
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
}

# Our AV with a draft model at K=7; with the cost table of
# `tiny_pair_at_depth0` every step runs at depth 0.
OURS_DEPTH0 = {"method": "draft_model", "num_speculative_tokens": 7,
               "enable_adaptive_verification": True}


def prompt_ids(i: int) -> list[int]:
    return [3 + (i * 7 + j) % 50 for j in range(8)]


def tiny_pair_at_depth0(tmp: Path):
    """The tests' tiny pair, and the arms: plain decoding and ours with a
    cost table that makes drafting prohibitive (set in the environment,
    with calibration off, so it stays so)."""
    from test_adaptive_depth import prohibitive_drafting_table
    from tiny_models import build_tiny_models

    models = build_tiny_models(tmp / "models")
    os.environ["VLLM_AV_COST_TABLE"] = prohibitive_drafting_table(tmp / "cost.json")
    os.environ["VLLM_AV_CALIBRATE_COSTS"] = "0"
    return models, {"plain": None, "ours_depth0": OURS_DEPTH0}


STATE = {"on": False}
CALLS: dict[str, list[float]] = defaultdict(list)  # ms per call
STEP: dict[str, list[float]] = defaultdict(list)  # ms per step, per step index
# The same in CPU time of the calling thread (time.thread_time): the work itself,
# without the time the thread waits for the GIL or a core (with async scheduling
# the runner's model forward runs at the same time on this 2-core machine).
CALLS_CPU: dict[str, list[float]] = defaultdict(list)
STEP_CPU: dict[str, list[float]] = defaultdict(list)
LOOKAHEAD: Counter = Counter()  # num_lookahead_tokens asked per allocate_slots call
NEW_TOKENS: Counter = Counter()  # num_new_tokens per allocate_slots call
STEP_INFO: list[dict] = []


def _current_step_add(name: str, ms: float, cpu_ms: float | None) -> None:
    CALLS[name].append(ms)
    if cpu_ms is not None:
        CALLS_CPU[name].append(cpu_ms)
    if STEP["schedule"]:
        idx = len(STEP["schedule"]) - 1
        for table, v in ((STEP, ms), (STEP_CPU, cpu_ms)):
            if v is None:
                continue
            lst = table[name]
            while len(lst) <= idx:
                lst.append(0.0)
            lst[idx] += v


def _wrap(name: str, spec: str) -> bool:
    found = resolve_method(spec)
    if found is None:
        return False
    cls, meth, orig = found
    perf = time.perf_counter
    tt = time.thread_time

    if name == "allocate_slots":
        @functools.wraps(orig)
        def timed(self, request, num_new_tokens, *a, **k):
            if not STATE["on"]:
                return orig(self, request, num_new_tokens, *a, **k)
            # wall only: thread_time is a syscall (about 1 us here), too dear per request
            t0 = perf()
            out = orig(self, request, num_new_tokens, *a, **k)
            ms = (perf() - t0) * 1e3
            _current_step_add(name, ms, None)
            la = k.get("num_lookahead_tokens", a[2] if len(a) > 2 else 0)
            LOOKAHEAD[int(la)] += 1
            NEW_TOKENS[int(num_new_tokens)] += 1
            return out
    elif name == "schedule":
        @functools.wraps(orig)
        def timed(self, *a, **k):
            if not STATE["on"]:
                return orig(self, *a, **k)
            STEP["schedule"].append(0.0)  # opens a step; calls inside and after add to it
            STEP_CPU["schedule"].append(0.0)
            c0, t0 = tt(), perf()
            out = orig(self, *a, **k)
            t1, c1 = perf(), tt()
            _current_step_add(name, (t1 - t0) * 1e3, (c1 - c0) * 1e3)
            spec = out.scheduled_spec_decode_tokens
            STEP_INFO.append({
                "reqs": len(out.num_scheduled_tokens),
                "new_reqs": len(out.scheduled_new_reqs),
                "tokens": out.total_num_scheduled_tokens,
                "spec_tokens": sum(len(v) for v in spec.values()),
                "num_spec_tokens_to_schedule": getattr(out, "num_spec_tokens_to_schedule", None),
            })
            return out
    else:
        @functools.wraps(orig)
        def timed(*a, **k):
            if not STATE["on"]:
                return orig(*a, **k)
            c0, t0 = tt(), perf()
            out = orig(*a, **k)
            t1, c1 = perf(), tt()
            _current_step_add(name, (t1 - t0) * 1e3, (c1 - c0) * 1e3)
            return out

    setattr(cls, meth, timed)
    return True


def kv_groups(llm) -> dict:
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    cfg = sched.kv_cache_config
    groups = []
    for g in cfg.kv_cache_groups:
        s = g.kv_cache_spec
        groups.append({
            "spec": type(s).__name__, "layers": list(g.layer_names),
            "block_size": getattr(s, "block_size", None),
            "head_size": getattr(s, "head_size", None),
            "num_kv_heads": getattr(s, "num_kv_heads", None),
            "page_size_bytes": getattr(s, "page_size_bytes", None),
        })
    mgr = sched.kv_cache_manager
    return {
        "scheduler_class": type(sched).__name__,
        "num_kv_cache_groups": len(cfg.kv_cache_groups),
        "groups": groups,
        "num_blocks": cfg.num_blocks,
        "single_type_managers": [type(m).__name__ for m in mgr.coordinator.single_type_managers],
        "coordinator": type(mgr.coordinator).__name__,
        "scheduler_num_spec_tokens": sched.num_spec_tokens,
        "scheduler_num_lookahead_tokens": sched.num_lookahead_tokens,
        "dynamic_sd_lookup": type(sched.dynamic_sd_lookup).__name__,
        "spec_decode_step_blocks": getattr(sched, "_spec_decode_step_blocks", None),
    }


def summarize(values: list[float]) -> dict:
    if not values:
        return {"calls": 0}
    return {"calls": len(values), "mean_ms": statistics.fmean(values),
            "median_ms": statistics.median(values), "total_ms": sum(values)}


def run_arm(models, spec, concurrency: int, max_tokens: int, repeats: int,
            async_scheduling: bool) -> dict:
    from conftest import make_llm, shutdown
    from vllm import SamplingParams

    extra = {"async_scheduling": True} if async_scheduling else {}
    llm = make_llm(models, spec=spec, max_num_seqs=max(concurrency, 1),
                   enforce_eager=os.environ.get("VLLM_AV_BENCH_EAGER", "1") == "1", **extra)
    groups = kv_groups(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids(i)} for i in range(concurrency)]
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    reps = []
    for _ in range(repeats):
        for t in (CALLS, STEP, CALLS_CPU, STEP_CPU, LOOKAHEAD, NEW_TOKENS):
            t.clear()
        STEP_INFO.clear()
        STATE["on"] = True
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        STATE["on"] = False
        steps = len(STEP["schedule"])
        # decode steps: no new request scheduled, every request scheduled
        decode = [i for i, s in enumerate(STEP_INFO) if s["new_reqs"] == 0
                  and s["reqs"] == concurrency]
        def per_step_of(table, only=None):
            out = {}
            for name, lst in table.items():
                lst = lst + [0.0] * (steps - len(lst))
                if only is not None:
                    lst = [lst[i] for i in only]
                if lst:
                    out[name] = {"mean_ms": statistics.fmean(lst),
                                 "median_ms": statistics.median(lst)}
            return out

        per_step, per_step_decode = per_step_of(STEP), per_step_of(STEP, decode)
        reps.append({
            "wall_s": wall, "steps": steps, "decode_steps": len(decode),
            "ms_per_step_wall": wall * 1e3 / steps,
            "per_step": per_step, "per_step_decode_steps": per_step_decode,
            "per_step_cpu": per_step_of(STEP_CPU),
            "per_step_cpu_decode_steps": per_step_of(STEP_CPU, decode),
            "per_call": {n: summarize(v) for n, v in CALLS.items()},
            "per_call_cpu": {n: summarize(v) for n, v in CALLS_CPU.items()},
            "allocate_slots_calls_per_step": len(CALLS["allocate_slots"]) / steps,
            "allocate_slots_num_lookahead_tokens": dict(LOOKAHEAD),
            "allocate_slots_num_new_tokens": dict(NEW_TOKENS),
            "spec_tokens_scheduled_total": sum(s["spec_tokens"] for s in STEP_INFO),
            "num_spec_tokens_to_schedule_values": dict(Counter(
                str(s["num_spec_tokens_to_schedule"]) for s in STEP_INFO)),
            "first_steps": STEP_INFO[:3],
        })
    shutdown(llm)
    return {"concurrency": concurrency, "max_tokens": max_tokens, "kv": groups, "repeats": reps}


def isolate(opts) -> int:
    import subprocess

    arms = opts.arms.split(",")
    result = None
    for rnd in range(opts.isolate):
        for c in [int(x) for x in opts.concurrency.split(",")]:
            for arm in (arms if rnd % 2 == 0 else arms[::-1]):
                part = Path(tempfile.mkdtemp(prefix="schedhost_part_")) / "part.json"
                cmd = [sys.executable, __file__, "--concurrency", str(c), "--arms", arm,
                       "--max-tokens", str(opts.max_tokens), "--repeats", str(opts.repeats),
                       "--out", str(part)] + (["--async-scheduling"] if opts.async_scheduling
                                              else [])
                proc = subprocess.run(cmd, capture_output=True, text=True)
                print("\n".join(l for l in proc.stdout.splitlines()
                                if l.startswith(("[", "  kv"))), flush=True)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:])
                    return proc.returncode
                sub = json.loads(part.read_text())
                if result is None:
                    result = dict(sub, runs=[], arms=arms,
                                  concurrencies=[int(x) for x in opts.concurrency.split(",")])
                    result["command"] = " ".join([sys.executable.split("/")[-1]] + sys.argv)
                    result["isolated_rounds"] = opts.isolate
                for r in sub["runs"]:
                    r["round"] = rnd
                    result["runs"].append(r)
                if opts.out:
                    opts.out.write_text(json.dumps(result, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="plain,ours_depth0")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--isolate", type=int, default=0, metavar="N",
                    help="run every (concurrency, arm) in its own process, N rounds, the arm "
                         "order alternating between rounds (plain first, then ours first, ...); "
                         "one engine per process")
    opts = ap.parse_args()
    if opts.isolate:
        return isolate(opts)
    if opts.async_scheduling:
        os.environ["VLLM_AV_TEST_CPU_ASYNC"] = "1"
    import vllm_av  # noqa: F401  (so our class can be wrapped before the engine exists)
    wrapped = {n: _wrap(n, s) for n, s in TIMED.items()}
    models, arms = tiny_pair_at_depth0(Path(tempfile.mkdtemp(prefix="schedhost_")))
    result = {
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
                   f"{os.cpu_count()} cpus, {platform.platform()}",
        "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                           if l.startswith("model name")), None),
        "async_scheduling": opts.async_scheduling, "arms": opts.arms.split(","),
        "concurrencies": [int(x) for x in opts.concurrency.split(",")],
        "max_tokens": opts.max_tokens, "wrapped": wrapped,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_AV", "VLLM_ENABLE"))},
        "runs": [],
    }
    for c in result["concurrencies"]:
        for arm in result["arms"]:
            r = run_arm(models, arms[arm], c, opts.max_tokens, opts.repeats,
                        opts.async_scheduling)
            r["arm"] = arm
            result["runs"].append(r)
            for i, rep in enumerate(r["repeats"]):
                ps, pc = rep["per_step"], rep["per_step_cpu"]
                print(f"[{arm}] C={c} rep{i}: wall {rep['ms_per_step_wall']:.2f} ms/step, "
                      + ", ".join(f"{n} {ps[n]['mean_ms']:.3f}/{ps[n]['median_ms']:.3f}"
                                  + (f" (cpu {pc[n]['mean_ms']:.3f})"
                                     if n != "allocate_slots" else "")
                                  for n in ("schedule", "update_from_output", "allocate_slots")
                                  if n in ps)
                      + f"; alloc calls/step {rep['allocate_slots_calls_per_step']:.1f}, "
                        f"lookahead {rep['allocate_slots_num_lookahead_tokens']}, "
                        f"spec tokens {rep['spec_tokens_scheduled_total']}", flush=True)
            print(f"  kv: {r['kv']['num_kv_cache_groups']} groups "
                  f"{[(g['spec'], g['head_size'], len(g['layers'])) for g in r['kv']['groups']]}, "
                  f"lookahead {r['kv']['scheduler_num_lookahead_tokens']}", flush=True)
            if opts.out:
                opts.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
