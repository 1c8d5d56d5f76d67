"""Engines of several arms alive at once, batches alternated between them:
throughput ratios and where each engine's step time goes, as served.

    python3 scripts/gpu/side_by_side.py --arms nospec,ours_v2g_d0,ours_served \
        --concurrency 64,256 --out side_by_side.json

Each arm gets its own engine (benchmarks/sweep.py's arm of that name: its
speculative config, environment and scheduling flags), built one after the
other in this driver, each in its own engine-core process as `vllm serve`
runs it (async scheduling where vLLM turns it on). The arms then take turns
on the same GPU: for each concurrency and repeat, every arm (in an order
rotated per repeat) generates the same C prompts to a fixed length
(ignore_eos), while the other engines sit idle. So every ratio is paired,
measured minutes apart at most, with no HTTP client in the way.

Inside each engine-core process, `vllm.LLM.collective_rpc` installs
time.perf_counter timers (no synchronisation) on the step's host phases:
the scheduler's `schedule` and `update_from_output`, the runner's
`execute_model` and `sample_tokens` (host time: launches, input
preparation, bookkeeping), and the wait for the step's output (`get_output`:
the copy event, the time the host waits for the GPU). Under async
scheduling the host runs a step ahead of the GPU: when the wait is near
zero the engine is host-bound and its step period is its host phases'
sum; a gap between two arms' periods then shows in the phase that grew.
Counts of the rejection sampler and the drafter's `propose` tell how many
steps verified or drafted. With `--gpu-spans`, CUDA events time each
step's GPU span as well (SPAN below): the step period less the span is
the time the GPU idles, which a step could fill with drafts at no cost to
its period. After a concurrency's repeats, `--cprofile C[,C...]` runs one more
batch per arm under cProfile (host time per function per step) and
`--kernel-profile C[,C...]` one under torch.profiler (device time per kernel per
step), each with every arm's difference from the first: where two
engines' host phases or GPU spans differ, function by function and
kernel by kernel. `--cprofile-first C[,C...]` profiles a batch before the
repeats instead, each engine's first full one, so that what an engine
does once early in its life (its first exploring step) shows by
function. `--cpus` confines the driver and every engine to the same CPUs
(engine processes of one run stepped at host speeds up to 28% apart in
vLLM's own phases; pinned, identical engines still read 12-16%
apart, twenty-seventh round). An arm named `<arm>_twin` (or `_twin2`, ...)
is one more engine with `<arm>`'s settings: its ratio over `<arm>` is what
identical engines read apart, the floor under every other ratio; with
twins the JSON also holds each arm's engines side by side (`groups`:
each engine's median, their spread, the groups' ratio, and the pooled
ratio per repeat: the geometric mean of a group's engines over the first
group's, batch by batch, with its interval over repeats; the same over
the repeats in which none of a group's engines drafted; and where the
group's steps spend their time, its engines' mean ms per step and per
phase beside the first group's). Each batch also records
what the machine's CPUs did meanwhile (how many were busy, the
hypervisor's steal, the clock), to tell a slow batch's cause.

The JSON holds, per concurrency, arm and repeat: wall time, output tokens,
tokens/s, steps, and per phase calls and ms per step; and the paired
ratios of each arm over the first (median over repeats, min-max, and a
90% bootstrap interval of the median). It is written after every repeat,
so a run cut off keeps its batches; `--summarise-log LOG` rebuilds the
summaries from a run's log alone (over the repeats every arm finished).
Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set here) for the timers'
functions to reach the engine processes. With one GPU the worker lives in
the engine-core process, beside the scheduler; where vLLM runs workers in
processes of their own (the CPU backend), the scheduler's phases are not
timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

# phase -> "module:Class.method" candidates (Model Runner V2, then V1 / CPU).
PHASES = {
    "schedule": ["vllm.v1.core.sched.scheduler:Scheduler.schedule"],
    "update_from_output": ["vllm.v1.core.sched.scheduler:Scheduler.update_from_output"],
    "execute_model": ["vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",
                      "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model"],
    "sample_tokens": ["vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
                      "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"],
    "wait_output": ["vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output",
                    "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.get_output"],
    # Model Runner V2's launch of a step's forward (a FULL graph replay, or
    # the piecewise graphs); the drafter's own replays inside
    # `sample_tokens` count here too when they go through these classes.
    "forward_launch": ["vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager.run_fullgraph",
                       "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.run_pw_graph"],
    # counts: steps that verified / drafted
    "rejection": ["vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
                  "vllm.v1.sample.rejection_sampler:RejectionSampler.forward"],
    "propose": ["vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator:"
                "StandaloneARSpeculator.propose",
                "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids"],
}
STEP_PHASE = "execute_model"
# With --gpu-spans: a step's GPU span runs from its forward's launch (an
# event recorded before the first `forward_launch` of the step) to the end
# of its `sample_tokens` work (an event recorded after it): what the GPU
# spends on the step from the forward on, gaps inside the step included
# (input preparation before the forward is left out). The step period
# less the span is GPU time idle, waiting for the host.
SPAN = ("forward_launch", "sample_tokens")


def cuda_events():
    """(In the engine process.) A timing event factory and the synchronise
    that makes their times readable, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return (lambda: torch.cuda.Event(enable_timing=True)), torch.cuda.synchronize


def method_resolver():
    """(In the engine process.) The benchmarks' method lookup
    (`method_spec.resolve_method`), imported from this checkout: the
    installers reach the engine process by value, with no path of theirs."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    from method_spec import resolve_method

    return resolve_method


def install_timers(worker, phases: dict, span: tuple | None = None, events=None) -> dict:
    """(In the engine process.) Wrap every method of each phase that this
    vLLM defines (the runner that is not in use never calls its own) with a
    perf_counter timer; returns phase -> methods wrapped. The totals live
    on the worker object, which outlives this call. With `span` (the phases
    that open and close a step's GPU span, see SPAN), events from `events`
    (default: CUDA's, `cuda_events`; none without CUDA) are recorded at
    the first opening call of a step and after its closing call."""
    import functools
    import time as _time

    resolve_method = method_resolver()
    if getattr(worker, "_side_by_side", None) is not None:
        return worker._side_by_side["wrapped"]
    totals: dict = {}
    state = {"totals": totals, "wrapped": {}, "span": None}
    if span is not None:
        events = events or cuda_events()
        if events is not None:
            state["span"] = {"open": span[0], "close": span[1], "new": events[0],
                             "sync": events[1], "pending": None, "pairs": []}
    sp = state["span"]
    for phase, specs in phases.items():
        for spec in specs:
            found = resolve_method(spec)
            if found is None:
                continue
            cls, meth, orig = found

            def make(orig=orig, phase=phase):
                opens = sp is not None and phase == sp["open"]
                closes = sp is not None and phase == sp["close"]

                @functools.wraps(orig)
                def timed(*a, **k):
                    if opens and sp["pending"] is None:
                        sp["pending"] = sp["new"]()
                        sp["pending"].record()
                    t0 = _time.perf_counter()
                    try:
                        return orig(*a, **k)
                    finally:
                        slot = totals.setdefault(phase, [0, 0.0])
                        slot[0] += 1
                        slot[1] += (_time.perf_counter() - t0) * 1e3
                        if closes and sp["pending"] is not None:
                            end = sp["new"]()
                            end.record()
                            sp["pairs"].append((sp["pending"], end))
                            sp["pending"] = None
                return timed

            setattr(cls, meth, make())
            state["wrapped"].setdefault(phase, []).append(spec)
    worker._side_by_side = state
    return state["wrapped"]


def install_gc_timer(worker) -> bool:
    """(In the engine process, after `install_timers`.) Time the cyclic
    collector: each collection adds its wall time to phase `gc_gen<N>` of
    the totals (calls, ms), so a batch's per-step tables show what the
    collector took. A collection's time lands in whatever code triggered
    it, which a profile then shows as that code running slower. Returns
    False where it was already installed."""
    import gc
    import time as _time

    state = worker._side_by_side
    if state.get("gc_timer"):
        return False
    totals, started = state["totals"], []

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [_time.perf_counter()]
        elif started:
            slot = totals.setdefault(f"gc_gen{info['generation']}", [0, 0.0])
            slot[0] += 1
            slot[1] += (_time.perf_counter() - started.pop()) * 1e3

    gc.callbacks.append(timer)
    state["gc_timer"] = timer
    return True


def install_step_probe(worker, every: int, n: int, specs: list[str] | None = None) -> bool:
    """(In the engine process, after `install_timers`.) Before every
    `every`-th step (a call of the runner's `execute_model`, STEP_PHASE, or
    of `specs`), time `_python_workload(n)` on the thread that steps: the
    process's Python speed while it serves, with its other threads, its GPU
    work in flight and its state as a step finds them, where `python_speed`
    reads it between batches. Its calls and ms go to phase `py_probe` of
    the totals (and into the step's wall time, alike in every arm).
    Returns False where it was already installed or no method exists."""
    import functools
    import time as _time

    resolve_method = method_resolver()
    state = worker._side_by_side
    if state.get("step_probe") or every < 1:
        return False
    totals, count, wrapped = state["totals"], [0], []
    for spec in specs or PHASES[STEP_PHASE]:
        found = resolve_method(spec)
        if found is None:
            continue
        cls, meth, orig = found

        def make(orig=orig):
            @functools.wraps(orig)
            def probed(*a, **k):
                count[0] += 1
                if count[0] % every == 0:
                    t0 = _time.perf_counter()
                    _python_workload(n)
                    slot = totals.setdefault("py_probe", [0, 0.0])
                    slot[0] += 1
                    slot[1] += (_time.perf_counter() - t0) * 1e3
                return orig(*a, **k)
            return probed

        setattr(cls, meth, make())
        wrapped.append(spec)
    state["step_probe"] = wrapped
    return bool(wrapped)


def probe_ms(run: dict) -> float | None:
    """ms of one in-step probe in a batch (`install_step_probe`), or None."""
    phase = run.get("phases", {}).get("py_probe")
    if not phase or not phase.get("calls"):
        return None
    return phase["ms_per_step"] * run["steps"] / phase["calls"]


def median_probe_ms(batches: list[dict]) -> float | None:
    """An engine's median ms of one in-step probe over its batches, or None
    unless every batch was probed."""
    ms = [probe_ms(r) for r in batches]
    if not ms or any(x is None for x in ms):
        return None
    return statistics.median(ms)


def _python_workload(n: int) -> int:
    """A fixed piece of pure Python in the shape of the scheduler's work
    (small objects, attribute and dict access, short calls, list appends)."""
    class Req:
        __slots__ = ("rid", "computed", "tokens")

        def __init__(self, rid: int) -> None:
            self.rid, self.computed, self.tokens = rid, 0, []

        def advance(self, k: int) -> int:
            self.computed += k
            return self.computed

    reqs = {i: Req(i) for i in range(256)}
    out = []
    for step in range(n):
        r = reqs[step & 255]
        r.tokens.append(step)
        if r.advance(1) > 64:
            r.tokens.clear()
            r.computed = 0
        out.append((r.rid, len(r.tokens)))
    return len(out)


def workload_times(runs: int, n: int) -> list[float]:
    """Seconds of each of `runs` runs of `_python_workload(n)`."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        _python_workload(n)
        times.append(time.perf_counter() - t0)
    return times


def frame_hooks() -> dict:
    """What this process has set that runs on every frame: tracing and
    profiling hooks, sys.monitoring tools (Python 3.12 on)."""
    monitoring = getattr(sys, "monitoring", None)
    return {"trace": sys.gettrace() is not None, "profile": sys.getprofile() is not None,
            "monitoring_tools": ([monitoring.get_tool(i) for i in range(6)]
                                 if monitoring is not None else None)}


def python_speed(worker, runs: int = 7, n: int = 20000) -> dict:
    """(In the engine process, on the thread that schedules and steps.)
    The median time of a fixed pure-Python workload: the process's Python
    speed, which is what a host-bound step is made of. Two engines whose
    steps differ by more than their Python speeds do differ in work. With
    it, what could slow every frame of a process: `frame_hooks`, other
    threads (which take the GIL), the collector's counts."""
    import gc
    import threading

    return {"ms": statistics.median(workload_times(runs, n)) * 1e3,
            "threads": sorted(t.name for t in threading.enumerate()),
            **frame_hooks(),
            "gc_counts": list(gc.get_count()), "gc_frozen": gc.get_freeze_count(),
            # Objects a full collection walks (those frozen at start-up not counted).
            "gc_tracked": len(gc.get_objects()),
            "gc_collections": [g["collections"] for g in gc.get_stats()]}


def process_cpu(worker) -> dict:
    """(In the engine process.) CPU seconds so far of each of its threads
    (by name) and of each of its child processes (by command), from /proc
    where the platform has it: a batch's difference names what ran beside
    the stepping thread (a thread holding the GIL, a worker pool)."""
    import os as _os

    tick = _os.sysconf("SC_CLK_TCK")

    def cpu_s(stat_path: str, fields_to: int) -> float:
        # utime, stime (and with 15: the ended children's, a pool's).
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:fields_to]) / tick

    out = {"threads": {}, "children": {}}
    for tid in _os.listdir("/proc/self/task") if _os.path.isdir("/proc/self/task") else ():
        try:  # one that ends meanwhile is left out, not the whole sample
            with open(f"/proc/self/task/{tid}/comm") as f:
                out["threads"][f"{f.read().strip()} ({tid})"] = cpu_s(
                    f"/proc/self/task/{tid}/stat", 13)
            with open(f"/proc/self/task/{tid}/children") as f:
                pids = f.read().split()
        except (OSError, ValueError, IndexError):
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    cmd = c.read().replace(b"\0", b" ").decode(errors="replace")[:80]
                out["children"][f"{cmd} ({pid})"] = cpu_s(f"/proc/{pid}/stat", 15)
            except (OSError, ValueError, IndexError):
                continue
    return out


def cpu_during(before: dict, after: dict, top: int = 5) -> dict:
    """The threads and child processes that used the most CPU between two
    `process_cpu` samples (new ones count from zero), in seconds."""
    out = {}
    for kind in ("threads", "children"):
        d = {k: v - before.get(kind, {}).get(k, 0.0) for k, v in after.get(kind, {}).items()}
        out[kind] = dict(sorted(((k, round(v, 3)) for k, v in d.items() if v > 0),
                                key=lambda kv: -kv[1])[:top])
    return out


def take_totals(worker) -> dict:
    """(In the engine process.) phase -> [calls, ms] since the last take;
    with spans, "gpu_span" -> [steps, ms of GPU span]."""
    state = worker._side_by_side
    out = {k: list(v) for k, v in state["totals"].items()}
    state["totals"].clear()
    sp = state["span"]
    if sp is not None and sp["pairs"]:
        sp["sync"]()
        out["gpu_span"] = [len(sp["pairs"]),
                           sum(a.elapsed_time(b) for a, b in sp["pairs"])]
        sp["pairs"].clear()
    return out


def start_cprofile(worker) -> None:
    """(In the engine process.) Profile the thread that runs the steps (the
    one this call reaches: with one GPU, the engine core's, which runs the
    scheduler and the worker both)."""
    import cProfile

    worker._side_by_side_cprofile = prof = cProfile.Profile()
    prof.enable()


def stop_cprofile(worker, path: str) -> str:
    """(In the engine process.) Stop the profile and write its stats."""
    prof = worker._side_by_side_cprofile
    prof.disable()
    prof.dump_stats(path)
    return path


def cprofile_rows(path: str, steps: int) -> dict:
    """function -> [calls, tottime ms, cumtime ms] per step, for every
    function in a profile of `steps` steps."""
    import pstats

    stats = pstats.Stats(path).stats
    rows = {}
    for (file, line, name), (_, calls, tt, ct, _callers) in stats.items():
        # A wrapped builtin is named with its address ("<function
        # Event.record at 0x7f...>"), which differs between processes: left
        # in, the same function would read as one arm's gain and the other's
        # loss.
        name = re.sub(r" at 0x[0-9a-f]+", "", name)
        key = f"{file.split('site-packages/')[-1].replace(str(REPO) + '/', '')}:{line} {name}"
        row = rows.setdefault(key, [0.0, 0.0, 0.0])
        row[0] += calls / steps
        row[1] += tt * 1e3 / steps
        row[2] += ct * 1e3 / steps
    return rows


def top_rows(rows: dict, top: int = 80) -> dict:
    """The `top` functions of `cprofile_rows` by own time."""
    return {k: rows[k] for k in sorted(rows, key=lambda k: -rows[k][1])[:top]}


def cprofile_diff(base: dict, other: dict, top: int = 40) -> list:
    """The functions whose own time per step differs most between two
    `cprofile_rows` (other less base, ms), largest first."""
    keys = set(base) | set(other)
    zero = [0.0, 0.0, 0.0]
    diff = [(k, other.get(k, zero)[1] - base.get(k, zero)[1]) for k in keys]
    diff.sort(key=lambda kv: -abs(kv[1]))
    return [{"function": k, "tottime_ms_per_step_delta": d,
             "base": base.get(k, zero), "other": other.get(k, zero)} for k, d in diff[:top]]


def profile_arms(engines: dict, arms: list[str], prompts, args, out_dir: Path,
                 tag: str = "") -> dict:
    """One more batch per arm under cProfile (the engine's stepping thread):
    own time per function per step, and each arm's difference from the
    first arm's; the stats in `cprofile_<tag>_<arm>_c<C>.pstats` (no tag:
    `cprofile_<arm>_c<C>.pstats`)."""
    rows, every = {}, {}
    prefix = f"cprofile_{tag}_" if tag else "cprofile_"
    for name in arms:
        llm = engines[name]
        llm.collective_rpc(start_cprofile)
        cpu0 = llm.collective_rpc(process_cpu)[0]
        run = run_batch(llm, prompts, args.max_tokens)
        cpu = cpu_during(cpu0, llm.collective_rpc(process_cpu)[0])
        path = str(out_dir / f"{prefix}{name}_c{len(prompts)}.pstats")
        llm.collective_rpc(stop_cprofile, args=(path,))
        every[name] = cprofile_rows(path, run["steps"])
        # Phases too: the collector's time (gc_gen*) is spread by cProfile
        # over whichever functions it interrupted.
        rows[name] = {"steps": run["steps"], "tok_s": run["tok_s"], "host": run["host"],
                      "phases": run.get("phases", {}), "engine_cpu_s": cpu,
                      "functions": top_rows(every[name])}
        print(f"[cprofile C={len(prompts)}] {name}: {run['steps']} steps, "
              f"{run['ms_per_step']:.2f} ms/step under the profiler; stats in {path}; "
              f"host busy CPUs {run['host'].get('busy_cpus', float('nan')):.1f}; "
              + "".join(f"{k} {v['ms_per_step']:.3f} ms/step; "
                        for k, v in sorted(run.get("phases", {}).items()) if k.startswith("gc_"))
              + "engine CPU s "
              + "; ".join(f"{k}: " + ", ".join(f"{n} {v:.2f}" for n, v in list(d.items())[:3])
                          for k, d in cpu.items() if d),
              flush=True)
    for name in arms[1:]:
        # Over every function: one in the other arm's top list only is not
        # a difference.
        rows[name][f"diff_over_{arms[0]}"] = d = cprofile_diff(every[arms[0]], every[name])
        print(f"[cprofile C={len(prompts)}] {name} less {arms[0]}, own ms per step:", flush=True)
        for r in d[:25]:
            print(f"    {r['tottime_ms_per_step_delta']:+.4f}  {r['function']}", flush=True)
    return rows


def start_kernel_profile(worker) -> None:
    """(In the engine process.) torch.profiler over the steps to come, host
    ops and the GPU's kernels (graph replays' included)."""
    from torch.profiler import ProfilerActivity, profile

    import torch

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    worker._side_by_side_kprof = prof = profile(activities=activities)
    prof.start()


def stop_kernel_profile(worker, path: str) -> dict:
    """(In the engine process.) Stop the profile, write its table by own
    device time to `path`, and return name -> [calls, own device ms] for
    every op or kernel with device time of its own."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = worker._side_by_side_kprof
    prof.stop()
    averages = prof.key_averages()
    key = "self_device_time_total"
    if averages and not hasattr(averages[0], key):  # older torch names it after CUDA
        key = "self_cuda_time_total"
    with open(path, "w") as f:
        f.write(averages.table(sort_by=key, row_limit=60))
    return own_device_times(averages, key)


def own_device_times(events, key: str = "self_device_time_total") -> dict:
    """name -> [calls, own device ms] over profiler averages `events`, for
    those with device time of their own. Entries of one name are summed:
    a Triton kernel's launch (host) and the kernel itself share a name."""
    rows: dict = {}
    for e in events:
        us = getattr(e, key)
        if us > 0:
            row = rows.setdefault(e.key, [0, 0.0])
            row[0] += e.count
            row[1] += us / 1e3
    return rows


def kernel_diff(base: dict, other: dict, steps: tuple[int, int], top: int = 40) -> list:
    """The kernels whose own device time per step differs most between two
    `stop_kernel_profile` results of `steps` (base's, other's) steps (other
    less base, ms per step), largest first."""
    keys = set(base) | set(other)
    zero = [0, 0.0]
    per_step = [{k: [v[0] / n, v[1] / n] for k, v in rows.items()}
                for rows, n in ((base, steps[0]), (other, steps[1]))]
    diff = [(k, per_step[1].get(k, zero)[1] - per_step[0].get(k, zero)[1]) for k in keys]
    diff.sort(key=lambda kv: -abs(kv[1]))
    return [{"kernel": k, "device_ms_per_step_delta": d,
             "base": per_step[0].get(k, zero), "other": per_step[1].get(k, zero)}
            for k, d in diff[:top]]


def kernel_profile_arms(engines: dict, arms: list[str], prompts, args, out_dir: Path) -> dict:
    """One more batch per arm under torch.profiler: each op's and kernel's
    own device time per step (the table in `kernels_<arm>_c<C>.txt`), the
    total, and each arm's difference from the first arm's."""
    rows, every, steps = {}, {}, {}
    c = len(prompts)
    for name in arms:
        llm = engines[name]
        llm.collective_rpc(start_kernel_profile)
        run = run_batch(llm, prompts, args.max_tokens)
        path = str(out_dir / f"kernels_{name}_c{c}.txt")
        every[name] = llm.collective_rpc(stop_kernel_profile, args=(path,))[0]
        steps[name] = run["steps"]
        total = sum(v[1] for v in every[name].values()) / run["steps"]
        rows[name] = {"steps": run["steps"], "device_ms_per_step": total, "table": path}
        print(f"[kernels C={c}] {name}: {run['steps']} steps, own device time "
              f"{total:.3f} ms/step under the profiler; table in {path}", flush=True)
    for name in arms[1:]:
        rows[name][f"diff_over_{arms[0]}"] = d = kernel_diff(
            every[arms[0]], every[name], (steps[arms[0]], steps[name]))
        print(f"[kernels C={c}] {name} less {arms[0]}, own device ms per step:", flush=True)
        for r in d[:25]:
            print(f"    {r['device_ms_per_step_delta']:+.4f}  {r['kernel'][:110]}", flush=True)
    return rows


def concurrency_list(text: str) -> tuple[int, ...]:
    """"64" or "64,256": the concurrencies a per-concurrency option acts at."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected concurrencies such as 64,256")
    if any(c <= 0 for c in out):
        raise argparse.ArgumentTypeError(f"{text!r}: concurrencies are positive")
    return out


def load_prompts(paths: list[str]) -> list[str]:
    """The files' prompts taken in turn (one of each file, then the next),
    so that every batch mixes them."""
    sets = []
    for path in paths:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        sets.append([r.get("prompt") or r["messages"][0]["content"] for r in rows])
    texts = [s[i] for i in range(max(map(len, sets), default=0)) for s in sets if i < len(s)]
    if not texts:
        raise SystemExit(f"no prompts in {paths}")
    return texts


TWIN = re.compile(r"_twin\d*$")


def base_arm(name: str) -> str:
    """The sweep arm an engine runs: `<arm>_twin`, `<arm>_twin2`, ... are
    more engines with `<arm>`'s settings."""
    return TWIN.sub("", name)


def arm_settings(name: str, draft: str, device: str) -> tuple[dict | None, dict, dict]:
    """(speculative config, environment, LLM keyword arguments) of the
    sweep's arm `name` (or of its base arm, for a twin: a null control whose
    ratio over its base is the noise)."""
    import sweep

    arm = sweep.make_arm(base_arm(name), device=device)
    kwargs = {}
    if "--async-scheduling" in arm.args:
        kwargs["async_scheduling"] = True
    if "--no-async-scheduling" in arm.args:
        kwargs["async_scheduling"] = False
    return arm.speculative_config(draft), dict(arm.env), kwargs


def load_plugin_on() -> None:
    """Load our plugin in this driver with our AV selected, whatever the
    environment says: vLLM builds each engine's config here, where our
    config patch records the ours arms' options, before handing it to the
    engine's process (whose own environment, the arm's, decides what runs
    there). A config without the flag passes through it unchanged."""
    impl = os.environ.pop("VLLM_AV_IMPL", None)
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    finally:
        if impl is not None:
            os.environ["VLLM_AV_IMPL"] = impl


def eager_refusal(arm_specs: dict) -> str | None:
    """Why `--enforce-eager` cannot serve these arms (name -> speculative
    config), or None: vLLM 0.32 refuses adaptive verification on Model
    Runner V2 without full CUDA graphs, when the engine's config is built,
    after the arms before it have spent their start-ups."""
    av = [n for n, spec in arm_specs.items() if (spec or {}).get("enable_adaptive_verification")]
    if not av:
        return None
    return (f"--enforce-eager: {', '.join(av)} turn on adaptive verification, which vLLM "
            "0.32 refuses without full CUDA graphs; drop --enforce-eager or those arms")


def parse_cpus(spec: str) -> set[int]:
    """CPU numbers from a list such as "0-7" or "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise SystemExit(f"--cpus {spec!r}: expected a list such as 0-7 or 0-3,8")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpu_affinity(worker) -> list[int]:
    """(In the engine process.) The CPUs it may run on."""
    return sorted(os.sched_getaffinity(0))


def build_engine(name: str, args, device: str):
    from vllm import LLM

    spec, env, kwargs = arm_settings(name, args.draft, device)
    if env.get("VLLM_AV_IMPL") == "vllm":
        raise SystemExit(f"{name}: vLLM's own AV cannot share this driver, whose "
                         "plugin routes the flag to ours")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the engine process inherits it
    try:
        t0 = time.perf_counter()
        # As the sweep's servers (scripts/gpu/round.sh): a fixed KV cache,
        # so that the engines fit side by side.
        extra = {"kv_cache_memory_bytes": args.kv_bytes}
        if device == "gpu":
            extra["gpu_memory_utilization"] = 0.12
        if args.enforce_eager:
            extra["enforce_eager"] = True
        if args.jit_monitor_verbose:
            extra["jit_monitor_verbose"] = True
        llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs or max(args.concurrency), seed=0,
                  speculative_config=spec, generation_config="vllm", **extra, **kwargs)
        start_s = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wrapped = llm.collective_rpc(install_timers,
                                 args=(PHASES, SPAN if args.gpu_spans else None))[0]
    llm.collective_rpc(install_gc_timer)
    if args.step_probe:
        llm.collective_rpc(install_step_probe, args=(args.step_probe, args.step_probe_size))
    cpus = llm.collective_rpc(cpu_affinity)[0]
    print(f"[{name}] started in {start_s:.0f} s on {len(cpus)} CPUs; timers on {wrapped}",
          flush=True)
    return llm, {"env": env, "speculative_config": spec, "llm_kwargs": kwargs,
                 "start_s": start_s, "wrapped": wrapped, "cpus": cpus}


def host_sample() -> dict:
    """The machine's CPU time counters (/proc/stat, in ticks) and the mean
    clock of the CPUs this process may run on (/proc/cpuinfo), where the
    platform has them."""
    out = {"t": time.perf_counter()}
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        # user nice system idle iowait irq softirq steal
        ticks = [int(x) for x in fields[:8]] + [0] * (8 - len(fields[:8]))
        out["total"], out["idle"], out["steal"] = sum(ticks), ticks[3] + ticks[4], ticks[7]
    except (OSError, ValueError):
        pass
    try:
        mine, cpu, mhz = os.sched_getaffinity(0), None, []
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cpu = int(val)
                elif key == "cpu MHz" and cpu in mine:
                    mhz.append(float(val))
        if mhz:
            out["mhz"] = statistics.fmean(mhz)
    except (OSError, ValueError):
        pass
    return out


def host_during(before: dict, after: dict, ncpu: int) -> dict:
    """What the machine's CPUs did between two `host_sample`s: how many
    were busy on average (all processes, the idle engines' included), the
    share of time the hypervisor gave to others (steal), and the clock at
    the end."""
    out = {}
    if "total" in before and "total" in after and after["total"] > before["total"]:
        total = after["total"] - before["total"]
        out["busy_cpus"] = ncpu * (1 - (after["idle"] - before["idle"]) / total)
        out["steal_pct"] = 100 * (after["steal"] - before["steal"]) / total
    if "mhz" in after:
        out["mhz"] = after["mhz"]
    return out


def run_batch(llm, prompts, max_tokens: int, speed: bool = False) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    llm.collective_rpc(take_totals)  # drop what the warm-up or the last batch left
    h0 = host_sample()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    host = host_during(h0, host_sample(), os.cpu_count() or 1)
    totals = llm.collective_rpc(take_totals)[0]
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = totals.get(STEP_PHASE, [0, 0.0])[0] or 1
    run = {"wall_s": wall, "output_tokens": ntok, "tok_s": ntok / wall, "steps": steps,
           "ms_per_step": wall * 1e3 / steps, "host": host,
           "phases": {ph: {"calls": n, "ms_per_step": ms / steps}
                      for ph, (n, ms) in totals.items()}}
    if speed:  # after the batch: the engine is idle, its state as the batch left it
        run["python_speed"] = llm.collective_rpc(python_speed)[0]
    return run


def median_interval(values: list[float], level: float = 0.9, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of the median (seeded, so a summary
    is reproducible from its runs): with few repeats a wide interval says
    the median ranks nothing."""
    import random

    rng, n = random.Random(seed), len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo = meds[int((1 - level) / 2 * resamples)]
    hi = meds[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return lo, hi


def summarise(runs: dict, arms: list[str]) -> dict:
    """Per arm: median tokens/s, ms per step and phase ms per step over
    repeats; the paired ratio of tokens/s over the first arm (median,
    min-max, a 90% bootstrap interval of the median). The interval is over
    batches of these two engines: what separates engine processes of the
    same settings is not in it (`summarise_groups`)."""
    base = arms[0]
    out = {}
    for arm in arms:
        reps = runs[arm]
        phases = sorted({p for r in reps for p in r["phases"]})
        row = {"tok_s": statistics.median(r["tok_s"] for r in reps),
               "ms_per_step": statistics.median(r["ms_per_step"] for r in reps),
               "phases_ms_per_step": {p: statistics.median(
                   r["phases"].get(p, {}).get("ms_per_step", 0.0) for r in reps)
                   for p in phases},
               "phase_calls": {p: statistics.median(
                   r["phases"].get(p, {}).get("calls", 0) for r in reps) for p in phases}}
        if arm != base:
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(reps, runs[base])]
            lo, hi = median_interval(ratios)
            row[f"tok_s_over_{base}"] = {"median": statistics.median(ratios),
                                         "min": min(ratios), "max": max(ratios),
                                         "ci90": [lo, hi]}
        out[arm] = row
    return out


# (key suffix, whether a batch has the reading, its ms) for summarise_groups.
SPEED_YARDSTICKS = (
    ("per_output_speed", lambda run: "update_from_output" in run["phases"],
     lambda run: run["phases"]["update_from_output"]["ms_per_step"]),
    ("per_python_speed", lambda run: "python_speed" in run,
     lambda run: run["python_speed"]["ms"]),
)


def summarise_groups(runs: dict, arms: list[str]) -> dict:
    """With several engines per arm (twins): per base arm, each engine's
    median tokens/s and their spread (max / min: how far identical engines
    read apart for the whole run), and the ratio of the group's mean of
    engine medians over the first group's. An engine process keeps its host
    speed for its life (the twenty-seventh round read identical engines 11%
    apart, the 90% interval of the median excluding 1), so the engine, not
    the batch, is the unit a difference between arms must be judged by."""
    groups: dict[str, list[str]] = {}
    for arm in arms:
        groups.setdefault(base_arm(arm), []).append(arm)
    medians = {g: [statistics.median(r["tok_s"] for r in runs[a]) for a in members]
               for g, members in groups.items()}
    steps = {g: engines_step_ms(runs, members) for g, members in groups.items()}
    base = next(iter(groups))
    out = {}
    for g, members in groups.items():
        meds = medians[g]
        row = {"engines": members, "tok_s_median_per_engine": meds,
               "engine_spread": max(meds) / min(meds),
               "step_ms_mean_of_engines": steps[g]}
        if g != base:
            row[f"step_ms_minus_{base}"] = {k: v - steps[base][k] for k, v in steps[g].items()
                                            if k in steps[base]}
            row[f"tok_s_over_{base}"] = statistics.fmean(meds) / statistics.fmean(medians[base])
            # Where each of this group's engines falls against the base
            # group's engines: below all, among them, or above all.
            lo, hi = min(medians[base]), max(medians[base])
            row[f"engines_against_{base}"] = ["below" if m < lo else "above" if m > hi
                                               else "among" for m in meds]
            ratios = pooled_ratios_by_repeat(runs, members, groups[base])
            if ratios:
                row[f"tok_s_over_{base}_by_repeat"] = ratio_summary(ratios)
            if any(drafted(r) for a in members for r in runs[a]):
                # Without the repeats in which an engine of the group drafted
                # (an adaptive policy exploring): what its other steps cost.
                quiet = pooled_ratios_by_repeat(runs, members, groups[base],
                                                 skip=not_drafting_repeats(runs, members))
                if quiet:
                    row[f"tok_s_over_{base}_by_repeat_not_drafting"] = ratio_summary(quiet)
            # Each batch's tokens/s times a yardstick of its engine's speed
            # (ms of the same work): what is left is the work each step does.
            # `per_output_speed`: vLLM's per-request output code during that
            # very batch, the same work in both arms at a step that verifies
            # no draft; `per_python_speed`: the fixed workload after it. A
            # diagnostic: a process that runs slower because of ours is ours'
            # cost all the same.
            for suffix, has, ms in SPEED_YARDSTICKS:
                if all(has(r) for a in members + groups[base] for r in runs[a]):
                    ratios = pooled_ratios_by_repeat(
                        runs, members, groups[base], value=lambda run: run["tok_s"] * ms(run))
                    if ratios:
                        row[f"tok_s_over_{base}_by_repeat_{suffix}"] = ratio_summary(ratios)
        out[g] = row
    return out


def ratio_summary(ratios: list) -> dict:
    lo, hi = median_interval(ratios)
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "ci90": [lo, hi], "repeats": len(ratios)}


def engines_step_ms(runs: dict, members: list[str]) -> dict:
    """The mean over a group's engines of each engine's median ms per step
    (`step`) and per phase: where a group's steps spend their time."""
    per_engine = []
    for a in members:
        phases = sorted({p for r in runs[a] for p in r["phases"]})
        row = {"step": statistics.median(r["ms_per_step"] for r in runs[a])}
        row.update({p: statistics.median(r["phases"].get(p, {}).get("ms_per_step", 0.0)
                                         for r in runs[a]) for p in phases})
        probe = median_probe_ms(runs[a])
        if probe is not None:  # ms of one in-step probe
            row["py_probe_call"] = probe
        if all("python_speed" in r for r in runs[a]):  # ms of the fixed workload
            row["python"] = statistics.median(r["python_speed"]["ms"] for r in runs[a])
            if all("gc_tracked" in r["python_speed"] for r in runs[a]):
                row["gc_tracked"] = statistics.median(
                    r["python_speed"]["gc_tracked"] for r in runs[a])
        per_engine.append(row)
    keys = sorted(set().union(*per_engine), key=lambda k: (k != "step", k))
    return {k: statistics.fmean(e.get(k, 0.0) for e in per_engine) for k in keys}


def drafted(run: dict) -> bool:
    """Whether the batch ran the drafter (a timed `propose`; a run read
    from the log has the phase only where it was called)."""
    phase = run["phases"].get("propose")
    return phase is not None and phase.get("calls", 1) > 0


def not_drafting_repeats(runs: dict, members: list[str]):
    """A `skip` for pooled_ratios_by_repeat: the repeats in which some
    engine of `members` drafted."""
    skipped = {r.get("repeat", i) for a in members for i, r in enumerate(runs[a]) if drafted(r)}
    return skipped.__contains__


def summarise_concurrency(runs: dict, arms: list[str]) -> dict:
    """One concurrency's entry in the JSON: its runs, `summarise`, and
    `summarise_groups` where some arm has twins or the batches carry the
    engines' Python speed (the per-speed ratios are the groups')."""
    entry = {"runs": runs, "summary": summarise(runs, arms)}
    speed = all("python_speed" in r for a in arms for r in runs[a])
    if len({base_arm(a) for a in arms}) < len(arms) or (speed and len(arms) > 1):
        entry["groups"] = summarise_groups(runs, arms)
    return entry


def pooled_ratios_by_repeat(runs: dict, members: list[str], base_members: list[str],
                            skip=None, value=None) -> list:
    """Per repeat in which every engine of both groups ran: the geometric
    mean of the group's tokens/s over the base group's. A repeat's batches
    run back to back, so the host's drift over minutes cancels as in a
    paired ratio, and the mean over engines dilutes what each engine's own
    host speed adds; the interval over repeats then covers both, as far as
    the engines sampled do. `skip(repeat)`: leave that repeat out;
    `value(run)`: what is compared (tokens/s by default)."""
    value = value or (lambda run: run["tok_s"])

    def by_repeat(arm):
        return {r.get("repeat", i): value(r) for i, r in enumerate(runs[arm])}

    tables = {a: by_repeat(a) for a in members + base_members}
    common = sorted(r for r in set.intersection(*(set(t) for t in tables.values()))
                    if skip is None or not skip(r))

    def geomean(arms, r):
        return math.exp(statistics.fmean(math.log(tables[a][r]) for a in arms))

    return [geomean(members, r) / geomean(base_members, r) for r in common]


LOG_LINE = re.compile(r"\[C=(\d+) r=(\d+)\] (\w+): ([\d,.]+) tok/s, ([\d.]+) ms/step; (.*)")


def _pairs(text: str) -> dict:
    return {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", text)}


def runs_from_log(lines) -> dict:
    """{concurrency: {arm: [run, ...]}} from a run's log lines (the line
    printed after every batch): tokens/s, ms per step, phase ms per step
    and the host's readings, for a run cut off before it wrote a
    concurrency's JSON. Arms in their order of first appearance."""
    out: dict = {}
    for line in lines:
        m = LOG_LINE.match(line)
        if not m:
            continue
        c, r, arm, tok_s, ms, rest = m.groups()
        phases_text, _, host_text = rest.partition("; host ")
        host_text, _, python_text = host_text.partition("; python ")
        run = {"tok_s": float(tok_s.replace(",", "")), "ms_per_step": float(ms),
               "repeat": int(r), "host": _pairs(host_text),
               "phases": {k: {"ms_per_step": v} for k, v in _pairs(phases_text).items()}}
        speed = re.match(r"([\d.]+) ms", python_text)
        if speed:
            run["python_speed"] = {"ms": float(speed.group(1))}
        out.setdefault(int(c), {}).setdefault(arm, []).append(run)
    return out


def runs_from_json(path: str) -> dict:
    """{concurrency: {arm: [run, ...]}} from a run's JSON (`runs` of each
    concurrency), to summarise it again with the summaries of this code."""
    with open(path) as f:
        result = json.load(f)
    return {int(c): {arm: [dict(r, repeat=r.get("repeat", i)) for i, r in enumerate(runs)]
                     for arm, runs in entry["runs"].items()}
            for c, entry in result.get("by_concurrency", {}).items() if entry.get("runs")}


# Upper 5% points of Student's t for 1..30 degrees of freedom (a two-sided
# 90% interval); the normal's beyond.
T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
        1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711,
        1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def t_95(df: int) -> float:
    return T_95[df - 1] if df <= len(T_95) else 1.645


def engines_for(sd: float, half_width: float, limit: int = 1000) -> int:
    """Engines per arm (one sitting) for a 90% t interval of the ratio by
    engine no wider than ±half_width (log scale) at engine spread `sd`."""
    for n in range(2, limit + 1):
        if t_95(2 * n - 2) * sd * math.sqrt(2 / n) <= half_width:
            return n
    return limit


def by_engine(sittings: list[tuple[list[float], list[float]]], exact_limit: int = 100_000,
              resamples: int = 20_000, seed: int = 0) -> dict | None:
    """The engine as the unit. `sittings`: per sitting (its own engines),
    the base group's and the group's engine medians (tokens/s). Returns the
    ratio exp(mean over sittings of [mean log group - mean log base]); a
    90% Student t interval from the engines' spread within their group and
    sitting, pooled (`engine_sd`, of log tokens/s; df = engines - 2 x
    sittings); and the one-sided permutation p-values of a ratio as low
    (`p_below`) or as high (`p_above`) as this one when the arm labels are
    exchanged among each sitting's engines: exact over every labelling where
    they number at most `exact_limit`, else over `resamples` seeded draws.
    With two engines of each arm in one sitting the labellings are 6, so
    p_below cannot fall under 1/6: a sitting of few engines shows nothing at
    this unit, however many batches it ran. None without an engine in each
    group of some sitting."""
    import itertools
    import random

    logs = [([math.log(x) for x in base], [math.log(x) for x in group])
            for base, group in sittings if base and group]
    if not logs:
        return None
    diffs = [statistics.fmean(g) - statistics.fmean(b) for b, g in logs]
    n, mean = len(diffs), statistics.fmean(diffs)
    out = {"ratio": math.exp(mean), "sittings": n, "engines": [[len(b), len(g)] for b, g in logs],
           "ratio_per_sitting": [math.exp(d) for d in diffs]}
    df = sum(len(b) + len(g) - 2 for b, g in logs)
    if df > 0:
        ss = sum((x - statistics.fmean(v)) ** 2 for b, g in logs for v in (b, g) for x in v)
        sd = math.sqrt(ss / df)
        se = sd * math.sqrt(sum(1 / len(b) + 1 / len(g) for b, g in logs)) / n
        t = t_95(df)
        out.update(engine_sd=sd, df=df, ci90=[math.exp(mean - t * se), math.exp(mean + t * se)],
                   # What a round would need, at this spread, to read the
                   # ratio to within 2% or 3% (90%).
                   engines_per_arm_for={"2%": engines_for(sd, math.log(1.02)),
                                        "3%": engines_for(sd, math.log(1.03))})

    def labellings(b, g):
        pooled = b + g
        for pick in itertools.combinations(range(len(pooled)), len(g)):
            chosen = set(pick)
            yield (statistics.fmean(pooled[i] for i in pick)
                   - statistics.fmean(pooled[i] for i in range(len(pooled)) if i not in chosen))

    per_sitting = [list(labellings(b, g)) for b, g in logs]
    total = math.prod(len(v) for v in per_sitting)
    tol = 1e-12
    if total <= exact_limit:
        stats = [statistics.fmean(c) for c in itertools.product(*per_sitting)]
    else:
        rng = random.Random(seed)
        stats = [statistics.fmean(rng.choice(v) for v in per_sitting) for _ in range(resamples)]
    out["p_below"] = sum(x <= mean + tol for x in stats) / len(stats)
    out["p_above"] = sum(x >= mean - tol for x in stats) / len(stats)
    out["labellings"] = total
    return out


def engine_probes(runs: dict) -> dict:
    """{engine: median ms of one in-step probe over its batches}
    (`--step-probe`), for the engines whose every batch was probed: a
    process slower while it steps reads higher than its arm's others."""
    medians = {arm: median_probe_ms(batches) for arm, batches in runs.items()}
    return {arm: ms for arm, ms in medians.items() if ms is not None}


def keep_batches(by_c: dict, from_repeat: int = 0, no_drafting: bool = False) -> dict:
    """`runs_from_json`'s batches less those of repeats before
    `from_repeat` (an engine's first batch holds what it does once, early
    in its life) and, `no_drafting`, those whose engine drafted."""
    return {c: {arm: [r for r in runs if r["repeat"] >= from_repeat
                      and not (no_drafting and drafted(r))]
                for arm, runs in arms.items()}
            for c, arms in by_c.items()}


def pool_sittings(paths: list[str], base: str | None = None, from_repeat: int = 0,
                  no_drafting: bool = False) -> dict:
    """Per concurrency that every run in `paths` (JSONs of separate sittings,
    each its own engines) has: each group's pooled ratio per repeat over the
    base group's, the repeats of all sittings together (each sitting's
    ratios from its own engines, `pooled_ratios_by_repeat`), and its ratio
    with the engine as the unit (`by_engine`). The base group is `base`,
    or the first sitting's first group; a sitting without it is measured
    against its own first group. So sittings whose engines started in
    another order (the arms listed in another order) pool as one.
    `from_repeat`, `no_drafting`: pool only the batches `keep_batches`
    keeps (a repeat is paired only where every engine kept it)."""
    sittings = [keep_batches(runs_from_json(p), from_repeat, no_drafting) for p in paths]
    out: dict = {"sittings": paths, "by_concurrency": {}}
    if from_repeat or no_drafting:
        out["batches_kept"] = {"from_repeat": from_repeat, "no_drafting": no_drafting}
    for c in sorted(set.intersection(*(set(s) for s in sittings))):
        ratios: dict[str, list] = {}
        engines: dict[str, list] = {}
        want = base or base_arm(next(iter(sittings[0][c])))
        out.setdefault("base", {})[c] = want
        for runs in sittings:
            groups: dict[str, list[str]] = {}
            for arm in runs[c]:
                groups.setdefault(base_arm(arm), []).append(arm)
            base_group = want if want in groups else next(iter(groups))

            def medians(members):
                return [statistics.median(r["tok_s"] for r in runs[c][a]) for a in members
                        if runs[c][a]]

            for g, members in groups.items():
                if g == base_group:
                    continue
                key = f"{g}_over_{base_group}_by_repeat"
                ratios.setdefault(key, []).extend(
                    pooled_ratios_by_repeat(runs[c], members, groups[base_group]))
                engines.setdefault(f"{g}_over_{base_group}_by_engine", []).append(
                    (medians(groups[base_group]), medians(members)))
        row = {k: ratio_summary(v) for k, v in ratios.items() if v}
        row.update({k: e for k, e in ((k, by_engine(v)) for k, v in engines.items()) if e})
        probes = [engine_probes(runs[c]) for runs in sittings]
        if any(probes):
            row["step_probe_ms_by_sitting"] = probes
        out["by_concurrency"][c] = row
    return out


def summarise_log(path: str) -> dict:
    """The JSON's summaries rebuilt from a log (`runs_from_log`), over the
    repeats in which every arm ran; arms ordered as in the log. The run's
    command, date, machine and arms are taken from the JSON beside the log
    (same name, `.json`) where the run wrote one."""
    if path.endswith(".json"):  # a finished run's own batches: unrounded phase times
        by_c = runs_from_json(path)
    else:
        with open(path, errors="replace") as f:
            by_c = runs_from_log(f)
    arms_seen = [a for runs in by_c.values() for a in runs]
    result = {"from_log": os.path.basename(path), "arms": list(dict.fromkeys(arms_seen))}
    beside = Path(path).with_suffix(".json")
    if beside.is_file():
        run = json.loads(beside.read_text())
        result.update({k: run[k] for k in ("command", "date", "machine", "arms", "max_tokens",
                                           "repeats") if k in run})
    result["by_concurrency"] = {}
    for c, runs in by_c.items():
        arms = list(runs)
        full = set.intersection(*({r["repeat"] for r in runs[a]} for a in arms))
        runs = {a: sorted((r for r in runs[a] if r["repeat"] in full),
                          key=lambda r: r["repeat"]) for a in arms}
        result["by_concurrency"][str(c)] = {"repeats": len(full),
                                            **summarise_concurrency(runs, arms)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="nospec,ours_v2g_d0,ours_served",
                   help="sweep arm names; ratios are over the first")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", default=".gpu/prompts/mtbench.jsonl,.gpu/prompts/humaneval.jsonl")
    p.add_argument("--target", default=os.environ.get("TARGET_MODEL", ""))
    p.add_argument("--draft", default=os.environ.get("DRAFT_MODEL", ""))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-bytes", type=int, default=0,
                   help="KV cache per engine (default 6 GiB on a GPU, as the sweep's "
                        "servers, 256 MiB on the CPU)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="every engine's max_num_seqs (default: the largest --concurrency; "
                        "at 1, vLLM's mixed prefill + decode warm-up step cannot run)")
    p.add_argument("--gpu-spans", action="store_true",
                   help="also time each step's GPU span with CUDA events (see SPAN)")
    p.add_argument("--cprofile", type=concurrency_list, default=(), metavar="C[,C...]",
                   help="at each concurrency C (of --concurrency), after its repeats, one "
                        "more batch per arm under cProfile: own time per function per "
                        "step, and each arm's difference from the first, beside --out")
    p.add_argument("--cprofile-first", type=concurrency_list, default=(), metavar="C[,C...]",
                   help="at each concurrency C (of --concurrency), after the warm-up and "
                        "before the repeats, one batch per arm under cProfile (as "
                        "--cprofile; `cprofile_first_*` files, `cprofile_first` in the JSON): "
                        "what an engine does once, early in its life; the repeats then "
                        "start one batch later in each engine's life")
    p.add_argument("--kernel-profile", type=concurrency_list, default=(), metavar="C[,C...]",
                   help="at each concurrency C (of --concurrency), after its repeats, one "
                        "more batch per arm under torch.profiler: own device time per "
                        "op and kernel per step, and each arm's difference from the "
                        "first, beside --out")
    p.add_argument("--python-speed", action="store_true",
                   help="after each batch, time a fixed pure-Python workload in the "
                        "engine process (`python_speed`): each engine's Python speed "
                        "beside its steps, and what could slow its every frame")
    p.add_argument("--step-probe", type=int, default=0, metavar="N",
                   help="every N steps, time a fixed pure-Python workload on the "
                        "stepping thread before the step's execute_model (`install_step_probe`): "
                        "each engine's Python speed while it serves, as phase py_probe "
                        "(its time is in every arm's steps alike)")
    p.add_argument("--step-probe-size", type=int, default=1000,
                   help="the in-step workload's size (`_python_workload`'s n)")
    p.add_argument("--cpus", default="",
                   help="run this driver and every engine process on these CPUs only "
                        "(e.g. 0-7; the engines inherit it), so that each engine steps on "
                        "the same cores and a difference in host speed between engine "
                        "processes is not one of placement")
    p.add_argument("--jit-monitor-verbose", action="store_true",
                   help="vLLM's JIT monitor logs every kernel compiled while serving with "
                        "its constants and signature (default: one warning per kernel name)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="engines without CUDA graphs or compilation (fast start-ups; "
                        "host costs of the forward are then the eager ones); arms "
                        "without adaptive verification only")
    p.add_argument("--summarise-log", metavar="LOG",
                   help="start no engine: rebuild the summaries from LOG, a run's log "
                        "(one that was cut off before it wrote its JSON) or its JSON "
                        "(every batch with unrounded phase times), into --out")
    p.add_argument("--pool", nargs="+", metavar="JSON",
                   help="start no engine: pool the per-repeat group ratios of several "
                        "sittings' JSONs (each with its own engines) into --out, and the "
                        "ratio by engine (`by_engine`: the engine as the unit)")
    p.add_argument("--pool-base", metavar="ARM",
                   help="with --pool: the arm the others are measured against in every "
                        "sitting that has it (default: the first sitting's first arm)")
    p.add_argument("--pool-from-repeat", type=int, default=0, metavar="N",
                   help="with --pool: leave out each engine's batches before repeat N")
    p.add_argument("--pool-no-drafting", action="store_true",
                   help="with --pool: leave out the batches whose engine drafted "
                        "(at depth 0, its exploring steps)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.pool:
        result = pool_sittings(args.pool, args.pool_base, args.pool_from_repeat,
                               args.pool_no_drafting)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        for c, rows in result["by_concurrency"].items():
            print(f"[C={c}] " + "; ".join(
                f"{k} {v['median']:.3f} ({v['ci90'][0]:.3f}-{v['ci90'][1]:.3f}, {v['repeats']} repeats)"
                for k, v in rows.items() if "repeats" in v))
            for k, v in rows.items():
                if "labellings" in v:
                    ci = (f" ({v['ci90'][0]:.3f}-{v['ci90'][1]:.3f}, engine sd "
                          f"{v['engine_sd']:.3f})" if "ci90" in v else "")
                    print(f"[C={c}] {k} {v['ratio']:.3f}{ci}, p_below {v['p_below']:.3f} "
                          f"over {v['labellings']} labellings")
            for i, probes in enumerate(rows.get("step_probe_ms_by_sitting", [])):
                if probes:
                    print(f"[C={c}] sitting {i + 1} in-step probe ms: " + ", ".join(
                        f"{arm} {ms:.3f}" for arm, ms in probes.items()))
        return
    if args.summarise_log:
        if not os.path.isfile(args.summarise_log):
            raise SystemExit(f"--summarise-log {args.summarise_log}: no such file")
        result = summarise_log(args.summarise_log)
        if not result["by_concurrency"]:
            raise SystemExit(f"--summarise-log {args.summarise_log}: no batch lines in it")
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        for c, entry in result["by_concurrency"].items():
            print(f"[C={c}] {entry['repeats']} full repeats; " + "; ".join(
                f"{g} {row[k]['median']:.3f} ({row[k]['ci90'][0]:.3f}-{row[k]['ci90'][1]:.3f})"
                for g, row in entry.get("groups", {}).items() for k in row
                if k.endswith("_by_repeat")))
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not args.target or not args.draft:
        raise SystemExit("--target and --draft (or TARGET_MODEL and DRAFT_MODEL) are needed")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # This driver touches CUDA (the device check, our plugin's imports), so
    # the engine processes must be spawned, not forked.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    import torch

    device = "gpu" if torch.cuda.is_available() else "cpu"
    arms = args.arms.split(",")
    args.kv_bytes = args.kv_bytes or ((6 << 30) if device == "gpu" else (256 << 20))
    texts = load_prompts(args.prompts.split(","))
    if args.enforce_eager:
        refusal = eager_refusal({n: arm_settings(n, args.draft, device)[0] for n in arms})
        if refusal:
            raise SystemExit(refusal)
    if args.max_num_seqs and args.max_num_seqs < max(args.concurrency):
        raise SystemExit(f"--max-num-seqs {args.max_num_seqs}: below --concurrency "
                         f"{max(args.concurrency)}, whose batches would not run whole")
    for flag, cs in (("--cprofile", args.cprofile), ("--cprofile-first", args.cprofile_first),
                     ("--kernel-profile", args.kernel_profile)):
        for c in cs:
            if c not in args.concurrency:
                raise SystemExit(f"{flag} {c}: not one of --concurrency")
    if args.cpus:
        try:
            os.sched_setaffinity(0, parse_cpus(args.cpus))
        except OSError as e:
            raise SystemExit(f"--cpus {args.cpus}: {e} (this machine has CPUs "
                             f"{sorted(os.sched_getaffinity(0))})") from e
    load_plugin_on()
    engines, info = {}, {}
    for name in arms:
        engines[name], info[name] = build_engine(name, args, device)

    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": {"device": torch.cuda.get_device_name(0) if device == "gpu" else
                          platform.processor() or platform.machine(),
                          "cpus": os.cpu_count(), "pinned_to": args.cpus or None},
              "arms": info, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "by_concurrency": {}}
    for c in args.concurrency:
        prompts = [texts[i % len(texts)] for i in range(c)]
        for name in arms:  # warm-up: the batch shapes of this concurrency
            run_batch(engines[name], prompts, min(32, args.max_tokens))
        # Kept in the concurrency's entry as each repeat and the summary rewrite it.
        extra_entry = ({"cprofile_first": profile_arms(
            engines, arms, prompts, args, Path(args.out).resolve().parent, tag="first")}
            if c in args.cprofile_first else {})
        runs = {name: [] for name in arms}
        for r in range(args.repeats):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for name in order:
                run = run_batch(engines[name], prompts, args.max_tokens, args.python_speed)
                run["repeat"], run["position"] = r, order.index(name)
                runs[name].append(run)
                ph, host = run["phases"], run["host"]
                print(f"[C={c} r={r}] {name}: {run['tok_s']:,.0f} tok/s, "
                      f"{run['ms_per_step']:.2f} ms/step; "
                      + ", ".join(f"{k} {v['ms_per_step']:.2f}" for k, v in sorted(ph.items()))
                      + "; host " + ", ".join(f"{k} {v:.1f}" for k, v in host.items())
                      + (f"; python {run['python_speed']['ms']:.2f} ms, threads "
                         f"{len(run['python_speed']['threads'])}, gc tracked "
                         f"{run['python_speed']['gc_tracked']}"
                         if "python_speed" in run else ""),
                      flush=True)
            # After each repeat: a run cut off mid-concurrency keeps its batches.
            result["by_concurrency"][str(c)] = {"runs": runs, "repeats_done": r + 1,
                                                **extra_entry}
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        entry = summarise_concurrency(runs, arms)
        result["by_concurrency"][str(c)] = entry
        summary = entry["summary"]
        if "groups" in entry:
            for g, row in entry["groups"].items():
                print(f"[C={c}] {g}: {len(row['engines'])} engine(s), medians "
                      + ", ".join(f"{m:,.0f}" for m in row["tok_s_median_per_engine"])
                      + f" tok/s (spread {row['engine_spread']:.3f})"
                      + "".join(f"; {k} {v:.3f}" if isinstance(v, float) else f"; {k} {v}"
                                for k, v in row.items() if k.startswith(("tok_s_over",
                                                                         "engines_against"))
                                and not k.endswith("_by_repeat"))
                      + "".join(f"; per repeat {v['median']:.3f} (90% interval of the "
                                f"median {v['ci90'][0]:.3f}-{v['ci90'][1]:.3f})"
                                for k, v in row.items() if k.endswith("_by_repeat"))
                      + "".join(f"; per repeat not drafting {v['median']:.3f} over "
                                f"{v['repeats']} repeat(s)"
                                for k, v in row.items() if k.endswith("_not_drafting"))
                      + "".join(f"; per repeat per {k.rsplit('_per_', 1)[1].replace('_', ' ')} "
                                f"{v['median']:.3f} (90% interval of the median "
                                f"{v['ci90'][0]:.3f}-{v['ci90'][1]:.3f})"
                                for k, v in row.items()
                                if k.endswith(("_per_python_speed", "_per_output_speed"))),
                      flush=True)
                for k, v in row.items():
                    if k.startswith("step_ms_minus_"):
                        print(f"[C={c}] {g} {k.replace('_', ' ')} (ms per step, engines' "
                              "mean): " + ", ".join(f"{p} {d:+.3f}" for p, d in v.items()),
                              flush=True)
        for name in arms[1:]:
            s = summary[name][f"tok_s_over_{arms[0]}"]
            print(f"[C={c}] {name} / {arms[0]}: {s['median']:.3f} "
                  f"({s['min']:.3f}-{s['max']:.3f}; 90% interval of the median "
                  f"{s['ci90'][0]:.3f}-{s['ci90'][1]:.3f})", flush=True)
        result["by_concurrency"][str(c)].update(extra_entry)
        if c in args.cprofile:
            result["by_concurrency"][str(c)]["cprofile"] = profile_arms(
                engines, arms, prompts, args, Path(args.out).resolve().parent)
        if c in args.kernel_profile:
            result["by_concurrency"][str(c)]["kernels"] = kernel_profile_arms(
                engines, arms, prompts, args, Path(args.out).resolve().parent)
        with open(args.out, "w") as f:  # after each concurrency: a cut-off run keeps its part
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
