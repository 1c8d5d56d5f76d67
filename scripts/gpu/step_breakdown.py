"""Where the time of a speculative step goes, per phase, on the GPU.

    python3 scripts/gpu/step_breakdown.py --arm k7 --out breakdown_k7.json

Starts one in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the
runner lives in this process) on $TARGET_MODEL with $DRAFT_MODEL, and for
each concurrency runs a batch of requests twice at temperature 1 with fixed
output length:
  1. plain: wall time and output tokens/s, nothing added;
  2. timed: each runner phase wrapped with a CUDA synchronize before and
     after, so its wall time is its own (phases no longer overlap, so the
     sum exceeds the plain step time: read shares, not totals).
Phases: the target step (`execute_model`: input preparation + target
forward), sampling/verification (rejection sampler), drafting (the
drafter's propose) and the rest of `sample_tokens` (bookkeeping, our
admission feedback); the scheduler's `schedule` and `update_from_output`;
and, inside the target step on V1, the attention metadata build. The JSON
holds per-phase mean ms per call and calls.

Arms: nospec, nospecv1 (no speculation on Model Runner V1), kN (fixed K on
vLLM's default runner, V2 on GPU), kNv1 (fixed K on Model Runner V1), ours
(our AV at K=7 on V1), ours_v2 (ours inside Model Runner V2), vllm_av
(vLLM's AV at K=7 on V2); kNg and ours_v2g: with V2's draft model in our
FULL graphs (VLLM_AV_DRAFTER_GRAPHS=1); ours_v2g_keepkv, ours_v2g_cal,
ours_v2g_keepkv_cal: with the options of those names (as the sweep's arms).
`--async-scheduling` serves any arm with async scheduling;
`--torch-profile PATH` adds a torch.profiler op table of one batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from method_spec import resolve_method  # noqa: E402

PHASES = {
    # Model Runner V2 (vllm/v1/worker/gpu/)
    "target_step": ["vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",
                    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model"],
    "sample_tokens": ["vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
                      "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"],
    "rejection": ["vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
                  "vllm.v1.sample.rejection_sampler:RejectionSampler.forward"],
    "drafting": ["vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator:"
                 "StandaloneARSpeculator.propose",
                 "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids"],
    "schedule": ["vllm.v1.core.sched.scheduler:Scheduler.schedule"],
    "update_from_output": ["vllm.v1.core.sched.scheduler:Scheduler.update_from_output"],
    # Inside target_step on V1: every attention group's metadata (with a
    # draft model of another head size, the draft's groups too).
    "attention_metadata": ["vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata"],
}

TIMES: dict[str, list[float]] = defaultdict(list)
ACTIVE = {"on": False}


def _wrap(phase: str, spec: str) -> bool:
    import torch

    found = resolve_method(spec)
    if found is None:
        return False
    cls, meth, orig = found

    @functools.wraps(orig)
    def timed(*a, **k):
        if not ACTIVE["on"]:
            return orig(*a, **k)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig(*a, **k)
        torch.cuda.synchronize()
        TIMES[phase].append((time.perf_counter() - t0) * 1e3)
        return out

    setattr(cls, meth, timed)
    return True


def arm_config(arm: str, draft: str) -> tuple[dict | None, dict]:
    if arm == "nospec":
        return None, {}
    if arm == "nospecv1":
        return None, {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    av_spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 7,
               "enable_adaptive_verification": True}
    if arm in ("ours", "ours_plain", "ours_skipmeta", "vllm_av"):
        # ours_plain: ours with option async_plain_steps (with --async-scheduling);
        # ours_skipmeta: with option skip_draft_layer_metadata_v1
        spec = av_spec
        env = ({"VLLM_AV_IMPL": "ours", "VLLM_USE_V2_MODEL_RUNNER": "0"} if arm != "vllm_av"
               else {"VLLM_AV_IMPL": "vllm"})
        if arm == "ours_plain":
            env["VLLM_AV_ASYNC_PLAIN_STEPS"] = "1"
        if arm == "ours_skipmeta":
            env["VLLM_AV_SKIP_DRAFT_LAYER_METADATA_V1"] = "1"
        return spec, env
    if arm == "ours_v2" or arm.startswith("ours_v2g") or re.fullmatch(r"k\d+g", arm):
        # Model Runner V2 arms with our drafter graphs or options: as the
        # sweep defines them (benchmarks/sweep.py, make_arm).
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        import sweep

        a = sweep.make_arm(arm)
        return a.speculative_config(draft), dict(a.env)
    m = re.fullmatch(r"k(\d+)(v1)?", arm)
    if not m:
        raise SystemExit(f"unknown arm {arm}")
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": int(m.group(1))}
    return spec, ({"VLLM_USE_V2_MODEL_RUNNER": "0"} if m.group(2) else {})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arm", required=True)
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default=".gpu/prompts/humaneval.jsonl")
    p.add_argument("--out", required=True)
    p.add_argument("--async-scheduling", action="store_true",
                   help="serve with async scheduling (ours: depth chosen when scheduled)")
    p.add_argument("--torch-profile", default="",
                   help="also profile one untimed batch at the first concurrency with "
                        "torch.profiler (CPU + CUDA) and write its op table here")
    p.add_argument("--trace", default="",
                   help="with --torch-profile: also write the profiled batch's timeline "
                        "here as a gzipped Chrome trace (chrome://tracing, Perfetto)")
    args = p.parse_args()
    spec, env = arm_config(args.arm, os.environ["DRAFT_MODEL"])
    os.environ.update(env)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    wrapped = {ph: [s for s in specs if _wrap(ph, s)] for ph, specs in PHASES.items()}

    from vllm import LLM, SamplingParams

    texts = [json.loads(l).get("prompt") or json.loads(l)["messages"][0]["content"]
             for l in open(args.prompts)]
    llm = LLM(model=os.environ["TARGET_MODEL"], dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, gpu_memory_utilization=0.4, seed=0,
              speculative_config=spec, async_scheduling=args.async_scheduling)
    result = {"arm": args.arm, "env": env, "spec": spec, "wrapped": wrapped, "runs": []}
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts = [texts[i % len(texts)] for i in range(c)]
        sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=None)
        llm.generate(prompts[: min(c, 8)], sp, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        TIMES.clear()
        ACTIVE["on"] = True
        t1 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        timed_wall = time.perf_counter() - t1
        ACTIVE["on"] = False
        phases = {ph: {"calls": len(v), "mean_ms": sum(v) / len(v), "total_ms": sum(v)}
                  for ph, v in TIMES.items() if v}
        steps = phases.get("target_step", {}).get("calls") or 1
        run = {"concurrency": c, "plain_wall_s": wall, "output_tokens": ntok,
               "plain_tok_s": ntok / wall, "plain_ms_per_step_est": wall * 1e3 / steps,
               "timed_wall_s": timed_wall, "steps": steps, "phases": phases}
        result["runs"].append(run)
        print(f"[{args.arm}] c={c}: {ntok / wall:,.0f} tok/s plain, {steps} steps; "
              + ", ".join(f"{k} {v['mean_ms']:.2f} ms x{v['calls']}" for k, v in phases.items()),
              flush=True)
    if args.torch_profile:
        c = int(args.concurrency.split(",")[0])
        prompts = [texts[i % len(texts)] for i in range(c)]
        sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
        result["torch_profile"] = profile_batch(llm, prompts, sp, args.torch_profile,
                                                args.trace)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


# Host-blocking calls: each waits for the device (a 0-d read, a copy to
# pageable memory, an explicit synchronize), which under async scheduling
# stalls the CPU's lead over the GPU.
BLOCKING = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero",
            "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpy")


PY_FRAME = re.compile(r"\.py\(\d+\): ")


def blocking_sites(events, frames: int = 3) -> list[tuple[int, str, str]]:
    """(count, op, call site) of host-blocking calls, most frequent first.
    The call site is the innermost Python frames outside torch among the
    call's enclosing events (with_stack=True records Python functions as
    events named "file.py(line): name")."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for e in events:
        if e.name not in BLOCKING:
            continue
        site, p = [], e.cpu_parent
        while p is not None and len(site) < frames:
            if PY_FRAME.search(p.name) and "torch/" not in p.name:
                site.append(p.name)
            p = p.cpu_parent
        counts[(e.name, " <- ".join(site) or "?")] += 1
    return sorted(((n, op, where) for (op, where), n in counts.items()), reverse=True)


def gpu_busy_ms(events) -> float:
    """Time the GPU spent running kernels or copies: the union of their
    intervals (overlapping streams counted once)."""
    from trace_gaps import union  # this script's folder (scripts/gpu)

    spans = [(e.time_range.start, e.time_range.end) for e in events
             if getattr(e, "device_type", None) is not None
             and str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start]
    return sum(b - a for a, b in union(spans)) / 1e3  # us -> ms


def device_time_table(prof, rows: int = 40) -> str:
    """The profiled ops and kernels by their own device time, largest
    first: what a step spends on the GPU, kernel by kernel, to set two
    engines' tables side by side."""
    averages = prof.key_averages()
    try:
        return averages.table(sort_by="self_device_time_total", row_limit=rows)
    except (AttributeError, KeyError):  # older torch names it after CUDA
        return averages.table(sort_by="self_cuda_time_total", row_limit=rows)


def profile_batch(llm, prompts, sp, path: str, trace: str = "") -> dict:
    """One batch under torch.profiler (CPU and CUDA activity): the op
    table by host time and by own device time, the host-blocking calls by call site, how much of
    the batch's wall time the GPU was busy (the rest it waited for the
    host), the steps' count for per-step reading and, with `trace`, the
    timeline as a gzipped Chrome trace."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile

    steps0 = len(TIMES.get("target_step", []))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 with_stack=True) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=80)
    sites = blocking_sites(prof.events())
    busy = gpu_busy_ms(prof.events())
    with open(path, "w") as f:
        f.write(f"concurrency {len(prompts)}, {sp.max_tokens} tokens each\n{table}\n")
        f.write(f"\nby own device time\n{device_time_table(prof)}\n")
        f.write(f"\nGPU busy {busy:.1f} ms of {wall_ms:.1f} ms wall (profiled)\n")
        f.write("\nhost-blocking calls by call site (count, op, innermost frames)\n")
        for n, op, where in sites[:60]:
            f.write(f"{n:6d}  {op:28s} {where}\n")
    if trace:
        raw = trace + ".json"
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    return {"concurrency": len(prompts), "table": path, "steps_before": steps0,
            "wall_ms": wall_ms, "gpu_busy_ms": busy, "trace": trace,
            "blocking": [{"count": n, "op": op, "site": w} for n, op, w in sites[:60]]}


if __name__ == "__main__":
    sys.exit(main())
