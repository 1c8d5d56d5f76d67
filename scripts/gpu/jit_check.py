"""Which kernels an engine of ours compiles while serving (CUDA).

Starts one engine of ours (Model Runner V2, a draft model, adaptive
verification) per variant, each in its own process and all at once with vLLM's JIT monitor
verbose, serves batches at temperature 1, at temperature 0 and with top-p,
every step drafting (VLLM_AV_TEST_FIXED_DEPTH=K, so that the rejection
sampler runs from the first step), and counts the kernels the monitor saw
compiled after warm-up. Variants: `on` (the served-kernel warm-up, our
default), `off` (VLLM_AV_SERVED_KERNEL_WARMUP=0: vLLM's warm-up alone,
the negative control) and, with `--variants on,off,plain,one_slot`,
`plain` (vLLM without speculation: what its warm-up leaves to serving in
any engine) and `one_slot` (ours with max_num_seqs 1, where vLLM's mixed
warm-up step cannot run and ours warms with one request's prompts).

    python scripts/gpu/jit_check.py --target T --draft D --out jit_check.json

Prints one line per variant and writes the compiled kernels, the served
warm-up's log line and each engine's start-up time as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
import time

ENGINE = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    cfg = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    spec = None if cfg["plain"] else {"method": "draft_model", "model": cfg["draft"],
                                      "num_speculative_tokens": cfg["k"],
                                      "enable_adaptive_verification": True}
    llm = LLM(model=cfg["target"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
              max_num_seqs=cfg["max_num_seqs"], gpu_memory_utilization=0.2, seed=0,
              kv_cache_memory_bytes=cfg["kv_cache_memory_bytes"],
              jit_monitor_verbose=True,
              speculative_config=spec)
    print(f"STARTED {time.perf_counter() - t0:.1f}", flush=True)
    # Token ids below the tiny test models' vocabulary (64); lengths that
    # meet several block sizes of the drafter's input kernel.
    prompts = [{"prompt_token_ids": [3 + i % 60 for i in range(n)]}
               for n in (5, 9, 17, 33, 65)] * 4
    for sp in (SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
               SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, ignore_eos=True)):
        llm.generate(prompts, sp, use_tqdm=False)
        llm.generate(prompts[:1], sp, use_tqdm=False)
    print("SERVED", flush=True)
    """
)

# Ours with the served-kernel warm-up, ours without it (the negative
# control), plain vLLM without speculation (what vLLM's own warm-up leaves
# to serving in any engine), and ours with one request slot (MAX_NUM_SEQS).
VARIANTS = {"on": {}, "off": {"VLLM_AV_SERVED_KERNEL_WARMUP": "0"}, "plain": {"VLLM_AV_IMPL": "off"},
            "one_slot": {}}
MAX_NUM_SEQS = {"one_slot": 1}
# The engines start at once on one GPU, and vLLM's memory profile counts
# what the others allocate meanwhile as its own: with every engine on
# gpu_memory_utilization, one was left no KV cache ("No available memory for
# the cache blocks"). So all but `one_slot` get a fixed KV cache (no memory
# profile); `one_slot` keeps the profile, where vLLM captures only the
# largest FULL graphs and our cost profile runs steps at their sizes.
KV_CACHE_BYTES = {"one_slot": None}
FIXED_KV_CACHE_BYTES = 256 << 20
COMPILED = re.compile(r"JIT compilation during inference: (\w+)")


def start_variant(name: str, target: str, draft: str, k: int, max_model_len: int,
                  dtype: str, fixed_depth: bool = True):
    env = dict(os.environ, **VARIANTS[name])
    if fixed_depth and name != "plain":
        env["VLLM_AV_TEST_FIXED_DEPTH"] = str(k)
    cfg = {"target": target, "draft": draft, "k": k, "max_model_len": max_model_len,
           "dtype": dtype, "plain": name == "plain", "max_num_seqs": MAX_NUM_SEQS.get(name, 64),
           "kv_cache_memory_bytes": KV_CACHE_BYTES.get(name, FIXED_KV_CACHE_BYTES)}
    return subprocess.Popen([sys.executable, "-c", ENGINE, json.dumps(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_variant(name: str, proc, t0: float, timeout: float) -> dict:
    try:
        log, _ = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    started = re.search(r"STARTED ([\d.]+)", log)
    warmed = re.search(r"served kernels warmed in .*", log)
    return {
        "variant": name, "rc": proc.returncode, "served": "SERVED" in log,
        "start_s": float(started.group(1)) if started else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "compiled_while_serving": COMPILED.findall(log),
        # The monitor's lines (constants, signature) of what compiled.
        "compiled_lines": [line[:800] for line in log.splitlines() if COMPILED.search(line)],
        "served_warmup": warmed.group(0) if warmed else None,
        "log_tail": log[-3000:] if proc.returncode else "",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--variants", default="on,off")
    p.add_argument("--policy-depth", action="store_true",
                   help="let the policy choose the depth (default: every step drafts K)")
    p.add_argument("--dtype", default="bfloat16",
                   help="the models' dtype (bfloat16: the served one, whose unprocessed "
                        "logits the rejection kernels specialize on)")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # The variants' engines side by side (one GPU holds both): one start-up's time.
    t0 = time.perf_counter()
    names = args.variants.split(",")
    procs = {n: start_variant(n, args.target, args.draft, args.k, args.max_model_len, args.dtype,
                                not args.policy_depth)
             for n in names}
    results = []
    for name in names:
        r = finish_variant(name, procs[name], t0, args.timeout)
        print(f"[{name}] rc {r['rc']}, started in {r['start_s']} s, served {r['served']}; "
              f"compiled while serving: {r['compiled_while_serving'] or 'nothing'}", flush=True)
        if r["rc"]:
            print(r["log_tail"], flush=True)
        results.append(r)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "target": args.target, "draft": args.draft, "k": args.k,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
