"""Our AV on the real pair on this CPU, in the driver's process: throughput,
and each step's period by the drafting depth chosen, against its price.

    python benchmarks/step_periods_by_depth.py --concurrency 1 --num-prompts 6 \
        --out benchmarks/results/cpu_20261205_stale_rows/periods_c1.json
    python benchmarks/step_periods_by_depth.py --concurrency 4 --num-prompts 8 --raw-rows
    python benchmarks/step_periods_by_depth.py --concurrency 4 --num-prompts 8 --fixed-k 1

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the
Qwen2.5-Coder 1.5B target and 0.5B draft that `python -m vllm_av.models`
prepares, bf16, eager, at most C requests at once (`max_num_seqs`): all
prompts are submitted together and the scheduler starts the next as one
finishes. Prompts alternate HumanEval and MT-Bench (as the main job's),
greedy, 128 output tokens each (`ignore_eos`). Under
synchronous scheduling the verifier chooses one depth per step, so the
time between two choices is one step, priced by the calibrated cost model
at the depth chosen first. `--raw-rows` keeps the stale-row map at the identity
(vllm_av/core/stale_rows.py); `--fixed-k N` is vLLM's draft_model at K = N
without our AV. Run nothing else on the machine meanwhile: on two cores a
second process halves every figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--fixed-k", type=int, default=0, help="vLLM's fixed K, no AV (0: ours)")
    ap.add_argument("--raw-rows", action="store_true", help="keep the stale-row map at the identity")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get(
        "VLLM_AV_CACHE", Path.home() / ".cache" / "vllm-av")))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_av.demo import load_prompts
    from vllm_av.vllm.mrv1.patches import verifier_of

    models = args.cache_dir / "models"
    K = args.fixed_k or args.K
    spec = {"method": "draft_model", "model": str(models / "qwen2.5-coder-0.5b-instruct"),
            "num_speculative_tokens": K}
    if not args.fixed_k:
        spec["enable_adaptive_verification"] = True
    llm = LLM(model=str(models / "qwen2.5-coder-1.5b-instruct"), dtype="bfloat16",
              max_model_len=2048, max_num_seqs=args.concurrency, enforce_eager=True,
              kv_cache_memory_bytes=1 << 30, speculative_config=spec)
    core = llm.llm_engine.engine_core.engine_core
    v = verifier_of(core.model_executor.driver_worker.worker.model_runner)
    if v is not None and args.raw_rows:
        v.row_calibration.add = lambda *a, **k: None
    choices = []  # (time, depth, requests, steady)
    if v is not None:
        choose = v.choose_depth

        def timed_choose(req_ids, *a, **kw):
            d = choose(req_ids, *a, **kw)
            choices.append((time.perf_counter(), d, len(req_ids), kw.get("may_explore", True)))
            return d

        v.choose_depth = timed_choose
        observe = v.observe
        outcomes = []  # (drafted depth, requests, verified, accepted) per verify step

        def counted_observe(req_ids, verified, accepted, *a, **kw):
            # The depth the verified drafts were made at: the most any
            # request verified (every draft is admitted at these sizes).
            ver = np.asarray(verified)
            if ver.size:
                outcomes.append((int(ver.max()), len(req_ids), int(ver.sum()),
                                 int(np.sum(accepted))))
            return observe(req_ids, verified, accepted, *a, **kw)

        v.observe = counted_observe

    # Every engine step, either arm: its wall time and what it scheduled,
    # to split the run into decode steps and steps carrying prompt tokens.
    engine_steps = []  # (ms, tokens, requests, draft tokens scheduled)
    step_fn, schedule = core.step_fn, core.scheduler.schedule
    last = {}

    def recording_schedule(*a, **kw):
        out = last["out"] = schedule(*a, **kw)
        return out

    def timed_step(*a, **kw):
        last["out"] = None
        t = time.perf_counter()
        result = step_fn(*a, **kw)
        out = last["out"]
        if out is not None and out.total_num_scheduled_tokens:
            drafts = sum(map(len, (out.scheduled_spec_decode_tokens or {}).values()))
            engine_steps.append(((time.perf_counter() - t) * 1e3, out.total_num_scheduled_tokens,
                                 len(out.num_scheduled_tokens), drafts))
        return result

    core.scheduler.schedule = recording_schedule
    core.step_fn = timed_step

    tok = llm.get_tokenizer()
    texts = [p["body"]["prompt"] if "prompt" in p["body"] else
             tok.apply_chat_template(p["body"]["messages"], tokenize=False, add_generation_prompt=True)
             for p in load_prompts(args.cache_dir / "prompts", args.num_prompts)]
    llm.generate(texts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    choices.clear()
    engine_steps.clear()
    if v is not None:
        outcomes.clear()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # All prompts at once: the scheduler keeps C running and starts the next
    # as one finishes (a closed loop, as C clients would), so policies whose
    # requests finish at different steps do not run batches of fewer.
    t0 = time.perf_counter()
    outs = llm.generate(texts, sp, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    arm = f"fixed_k{args.fixed_k}" if args.fixed_k else ("ours_raw_rows" if args.raw_rows else "ours")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "command": "python benchmarks/step_periods_by_depth.py " + " ".join(sys.argv[1:]),
              "arm": arm, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
              "tokens": tokens, "seconds": round(wall, 2), "tok_s": tokens / wall}
    print(f"{arm} C={args.concurrency}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.2f} tok/s")
    # A step carries prompt tokens when it schedules more than one token per
    # request beyond its drafts.
    prompt = [s for s in engine_steps if s[1] > s[2] + s[3]]
    decode = [s for s in engine_steps if s[1] <= s[2] + s[3]]
    result["engine_steps"] = {
        "steps": len(engine_steps), "ms": round(sum(s[0] for s in engine_steps), 1),
        "decode_steps": len(decode), "decode_ms": round(sum(s[0] for s in decode), 1),
        "prompt_steps": len(prompt), "prompt_ms": round(sum(s[0] for s in prompt), 1),
        "decode_steps_by_requests": {r: sum(1 for s in decode if s[2] == r)
                                     for r in sorted({s[2] for s in decode})}}
    e = result["engine_steps"]
    print(f"  engine steps {e['steps']} ({e['ms'] / 1e3:.1f} s): decode {e['decode_steps']} "
          f"({e['decode_ms'] / 1e3:.1f} s), with prompt tokens {e['prompt_steps']} "
          f"({e['prompt_ms'] / 1e3:.1f} s); decode steps by requests "
          f"{e['decode_steps_by_requests']}")
    if v is not None:
        by = collections.defaultdict(list)
        for (t1, d1, r1, e1), (t2, _, r2, e2) in zip(choices, choices[1:]):
            if r1 == r2 and e1 and e2:  # same batch, no prompt tokens
                by[(r1, d1)].append((t2 - t1) * 1e3)
        rows = []
        for (r, d), ms in sorted(by.items()):
            priced = (float(v.cost.verify_cost(r * (1 + d), plain=d == 0))
                      + float(v.cost.draft_cost_at_depth(r, d, K)))
            rows.append({"requests": r, "depth": d, "steps": len(ms),
                         "period_median_ms": round(float(np.median(ms)), 1),
                         "priced_ms": round(priced, 1)})
            print(f"  {r} requests, depth {d}: {len(ms)} steps, period median "
                  f"{np.median(ms):.0f} ms, priced {priced:.0f} ms")
        # Tokens per request per verify step by the depth its drafts were
        # made at: 1 + accepted / requests (its own token plus the accepted
        # drafts); depth-0 steps verify nothing and give 1.
        gained = collections.defaultdict(lambda: [0, 0, 0])
        for d, r, ver, acc in outcomes:
            g = gained[d]
            g[0] += 1
            g[1] += r
            g[2] += acc
        tokens_by_depth = {d: {"steps": g[0], "tokens_per_request": 1 + g[2] / max(g[1], 1)}
                           for d, g in sorted(gained.items())}
        print("  tokens per request per step by drafted depth: " + ", ".join(
            f"{d}: {t['tokens_per_request']:.2f} ({t['steps']})" for d, t in tokens_by_depth.items()))
        result.update({
            "tokens_by_depth": tokens_by_depth,
            "periods": rows, "depth_counts": list(v.stats.depth_counts),
            **{k: getattr(v.stats, k) for k in ("num_steps", "drafted", "verified", "accepted",
                                                  "trimmed")},
            "stale_row_map": {"intercepts": v.row_calibration.intercepts.tolist(),
                              "slope": v.row_calibration.slope},
            "stale_row_labels": v.row_calibration.num_labels,
            "verify_scale": v.cost.verify_scale, "plain_verify_scale": v.cost.plain_verify_scale,
            "draft_scale": v.cost.draft_scale})
        cal = v.row_calibration
        print(f"  depths {v.stats.depth_counts}, stale-row map: intercepts "
              f"{np.round(cal.intercepts, 2).tolist()}, slope {cal.slope:.2f} "
              f"({cal.num_labels} labels)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
