"""Does our first exploring step do one-time host work? (CPU, Model Runner V2)

On the H100 every engine of ours spent 0.14-0.21 s more host time in the
batch of its first exploring step than in its later batches (fortieth
round). This runs our V2 path on the CPU (scripts/mrv2_cpu_distribution.py's
engine: Triton interpreted, tiny pair, one request slot, the served
warm-up) under a cost table where drafting never pays, so the policy stays
at depth 0 and explores now and then, as it did there. Each runner call is
timed; both calls of each exploring step (the drafter runs in
`sample_tokens`) and of the step that verifies its drafts run under
cProfile, and so does the warm-up. Equal function-call counts at the
first exploration and the later ones mean our Python does no one-time
work there; no function called at the first exploration that the warm-up
did not call means the warm-up walks its whole Python path.

    python benchmarks/first_exploration_cpu.py --out first_exploration.json

About 2 minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _functions(prof) -> list[str]:
    import pstats

    return sorted(f"{path}:{name}" for path, _line, name in pstats.Stats(prof).stats)


def _warm_profiled(worker) -> dict:
    """(In the engine.) The served warm-up under cProfile; keeps the
    functions it called."""
    import cProfile

    import mrv2_cpu_distribution as cpu  # on the path `engine` set

    prof = cProfile.Profile()
    prof.enable()
    try:
        return cpu.served_warmup(worker)
    finally:
        prof.disable()
        worker._warmup_functions = _functions(prof)


def _record(worker) -> bool:
    """(In the engine.) Time every runner call; profile both calls of an
    exploring step and of the step after it."""
    import cProfile
    import pstats

    calls, profiles = [], []
    worker._first_exploration = (calls, profiles)
    execute, sample = worker.execute_model, worker.sample_tokens

    def run(name, fn, arg, profile, **fields):
        prof = cProfile.Profile() if profile else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        result = fn(arg)
        if prof:
            prof.disable()
        entry = {"call": name, **fields, "ms": (time.perf_counter() - t) * 1e3}
        if prof:
            entry["function_calls"] = pstats.Stats(prof).total_calls
            if len(profiles) < 4:  # the first exploration's four calls
                entry["functions"] = _functions(prof)
            profiles.append(len(calls))
        calls.append(entry)
        return result

    def depths():
        return [c["depth"] for c in calls if c["call"] == "execute_model"]

    def timed_execute(out):
        # An exploring step (depth > 0) or the one that verifies its drafts.
        depth = out.num_spec_tokens_to_schedule
        return run("execute_model", execute, out, bool(depth) or any(depths()[-1:]),
                   tokens=out.total_num_scheduled_tokens, depth=depth)

    def timed_sample(grammar):
        return run("sample_tokens", sample, grammar, any(depths()[-2:]))

    worker.execute_model, worker.sample_tokens = timed_execute, timed_sample
    return True


def _calls(worker):
    return worker._first_exploration[0], worker._warmup_functions


def engine(cfg: dict) -> None:
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "vllm")]
    import mrv2_cpu_distribution as cpu

    cpu._lift_refusals()
    managers = cpu.capture_managers()
    from vllm import SamplingParams

    spec = {"method": "draft_model", "model": cfg["draft"], "num_speculative_tokens": cfg["k"],
            "enable_adaptive_verification": True, "draft_sample_method": "probabilistic"}
    llm = cpu.start_engine(cfg["target"], spec, managers, max_num_seqs=1)
    warm = llm.collective_rpc(_warm_profiled)[0]
    llm.collective_rpc(_record)
    params = SamplingParams(temperature=1.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    for _ in range(cfg["requests"]):
        llm.generate([{"prompt_token_ids": cfg["prompt"]}], params, use_tqdm=False)
    calls, warm_functions = llm.collective_rpc(_calls)[0]
    print("RESULT " + json.dumps({"served_warmup": warm, "calls": calls,
                                  "warmup_functions": warm_functions}), flush=True)


def summarise(calls: list[dict], warmup_functions: list[str]) -> dict:
    """Per exploring step: the ms and function calls of its execute_model
    ("exploring") and sample_tokens ("drafting") calls and of the next
    step's ("verifying", "verifying_sample"); the functions the first
    exploration's four calls ran that the warm-up did not; the median of
    the other sample_tokens calls."""
    steps, i = [], 0
    while i < len(calls):
        c = calls[i]
        if c["call"] == "execute_model" and c["depth"] and c["tokens"] == 1:
            # This step's two calls (the drafter runs in sample_tokens),
            # then the verifying step's two.
            step = {"call_index": i}
            for name, x in zip(("exploring", "drafting", "verifying", "verifying_sample"),
                               calls[i:i + 4]):
                step[f"{name}_ms"] = round(x["ms"], 1)
                step[f"{name}_function_calls"] = x.get("function_calls")
            steps.append(step)
        i += 1
    plain = sorted(c["ms"] for c in calls if c["call"] == "sample_tokens" and
                   "function_calls" not in c)
    first = set().union(*(c.get("functions", ()) for c in calls))
    return {"explorations": steps,
            "first_exploration_functions": len(first),
            "warmup_functions": len(warmup_functions),
            "first_exploration_functions_not_in_warmup": sorted(first - set(warmup_functions)),
            "plain_sample_tokens_median_ms":
            round(plain[len(plain) // 2], 2) if plain else None,
            "steps": sum(c["call"] == "execute_model" for c in calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=190,
                    help="per request (the tiny models hold 256 positions)")
    ap.add_argument("--out")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine(json.loads(args.engine))
        return
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "vllm")]
    import mrv2_cpu_distribution as cpu
    from test_lossless_cpu import K, LONG_PROMPT
    from tiny_models import build_tiny_models

    from vllm_av.core.cost_model import CostModel

    work = Path(tempfile.mkdtemp(prefix="first_exploration_"))
    models = build_tiny_models(work / "models")
    # A drafting step costs four verifications: no depth pays, so the
    # policy stays at 0 and explores (every 400 steps, then doubling).
    costs = work / "costs.json"
    costs.write_text(CostModel.from_samples(cpu.FLAT_COSTS, {1: [40.0]}).to_json())
    env = cpu.engine_env(costs, VLLM_AV_IMPL="ours", VLLM_AV_MRV2="1",
                         VLLM_AV_METRICS_DIR=str(work / "metrics"))
    cfg = {"target": str(models.target), "draft": str(models.draft), "k": K,
           "prompt": LONG_PROMPT, "max_tokens": args.max_tokens, "requests": args.requests}
    print(f"[first-exploration] {args.requests} requests of {args.max_tokens} tokens; "
          f"engine log in {work}/engine.log", flush=True)
    _, raw = cpu.run_engine_process(__file__, cfg, env, work / "engine.log", "first-exploration")
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv), "k": K, "prompt_len": len(LONG_PROMPT),
              "served_warmup": raw["served_warmup"],
              **summarise(raw["calls"], raw["warmup_functions"])}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
