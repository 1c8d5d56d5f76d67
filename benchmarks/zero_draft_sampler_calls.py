"""How often vLLM's rejection sampler runs when most steps draft nothing.

A step that verifies no draft runs as plain decoding
(`PlainZeroDraftStepPatch`, vllm_av/vllm/mrv1/plain_step.py); with it off,
vLLM's V1 runner sends every step through its rejection sampler. One
in-process engine per arm (Model Runner V1, tiny test pair, K=7, greedy,
16 prompts x 100 tokens, a cost table in which drafting rarely pays:
verification flat at 1 ms, a K-deep drafting step 4 ms), counting calls of
vLLM's `Sampler.forward` and `RejectionSampler.forward`.

    python benchmarks/zero_draft_sampler_calls.py --out benchmarks/results/zero_draft_sampler_calls_cpu.json

Run each arm in its own process (`--arm on|off`): vLLM keeps per-process
state between engines. Without `--arm`, both arms run as subprocesses.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

K, NUM_PROMPTS, MAX_TOKENS = 7, 16, 100


def run_arm(plain_steps: bool, draft_head_size: int = 0) -> dict:
    from conftest import make_llm
    from test_av_engine import prompts
    from tiny_models import build_draft_with_head_size, build_tiny_models

    from vllm_av.core.cost_model import CostModel

    tmp = Path(tempfile.mkdtemp(prefix="zero-draft-"))
    models = build_tiny_models(tmp / "models")
    if draft_head_size:
        models = build_draft_with_head_size(models, draft_head_size)
    table = tmp / "cost.json"
    table.write_text(CostModel.from_samples({1: [1.0], 512: [1.0]}, {1: [4.0], 64: [4.0]},
                                            graph_sizes=[]).to_json())
    os.environ.update(VLLM_AV_COST_TABLE=str(table), VLLM_AV_CALIBRATE_COSTS="0",
                      VLLM_AV_PLAIN_ZERO_DRAFT_STEPS="1" if plain_steps else "0")

    from vllm import SamplingParams
    from vllm.v1.sample import rejection_sampler, sampler

    calls = collections.Counter()
    for module, name in ((sampler, "Sampler"), (rejection_sampler, "RejectionSampler")):
        cls = getattr(module, name)
        forward = cls.forward

        def counted(self, *args, _forward=forward, _name=name, **kwargs):
            calls[_name] += 1
            return _forward(self, *args, **kwargs)

        cls.forward = counted
    llm = make_llm(models, spec={"method": "draft_model", "num_speculative_tokens": K,
                                 "enable_adaptive_verification": True})
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
    # The rejection sampler calls the plain sampler itself: plain-sampler
    # calls are steps, rejection-sampler calls are steps through vLLM's
    # speculative path.
    return {"plain_zero_draft_steps": plain_steps, "steps": calls["Sampler"],
            "rejection_sampler_steps": calls["RejectionSampler"],
            "outputs": [list(o) for o in outputs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=("on", "off"))
    ap.add_argument("--draft-head-size", type=int, default=0,
                    help="a random draft with one attention head of this size (the "
                         "target's is 32): both models' layers then share one KV cache "
                         "group of mixed page sizes, as the real Qwen2.5-Coder pair's do")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm == "on", args.draft_head_size)))
        return
    arms = {}
    for arm in ("on", "off"):
        print(f"[zero-draft] arm {arm} ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--arm", arm,
                               "--draft-head-size", str(args.draft_head_size)], capture_output=True,
                              text=True, check=True)
        arms[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"[zero-draft] arm {arm}: {arms[arm]['rejection_sampler_steps']} of "
              f"{arms[arm]['steps']} steps through the rejection sampler", flush=True)
    same = arms["on"]["outputs"] == arms["off"]["outputs"]
    for a in arms.values():
        a.pop("outputs")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": "CPU", "K": K,
              "num_prompts": NUM_PROMPTS, "max_tokens": MAX_TOKENS,
              "draft_head_size": args.draft_head_size or None,
              "outputs_identical": same, "arms": arms}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
