"""vLLM's scheduler alone, with and without a speculative config, no model.

Companion of benchmarks/scheduler_host_costs.py: there the scheduler's host
time per step moves by tens of percent from one engine process to the next
on this 2-core VM (code both arms run identically moves with it), which
hides any difference between the arms. Here both arms live in one process
and alternate: one in-process engine per arm (tiny pair of the tests, async
scheduling, as the other script) only to get each arm's exact scheduler
inputs (VllmConfig, KV cache config, structured-output manager, block
sizes, block hasher; ours with its DepthFromVerifier installed by our
plugin); then fresh schedulers of the engine's class are driven with
--concurrency requests to --max-tokens by fake model outputs (one sampled
token per request per step, a batch queue of two steps as
EngineCore.step_with_batch_queue), with no model running anywhere, and
`schedule`, `update_from_output`, `KVCacheManager.allocate_slots` and ours'
depth lookup are timed with time.perf_counter.

    python benchmarks/scheduler_host_costs_nomodel.py --out /tmp/x.json

`--cprofile DIR`: each arm's timed drives also run under cProfile (one
profile per arm and concurrency, `DIR/<arm>_c<C>.pstats`, compared by
scripts/gpu/cprofile_compare.py): both arms in one process, so a function
that reads slower in one arm there cannot be a slower process.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict, deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from scheduler_host_costs import prompt_ids, tiny_pair_at_depth0  # noqa: E402  (sets the tests' path)

ON = {"on": False}
T: dict[str, float] = defaultdict(float)
N: Counter = Counter()
LOOKAHEAD: Counter = Counter()


def wrap(cls, meth: str, name: str) -> None:
    orig = cls.__dict__[meth]
    perf = time.perf_counter

    @functools.wraps(orig)
    def timed(*a, **k):
        if not ON["on"]:
            return orig(*a, **k)
        t0 = perf()
        out = orig(*a, **k)
        T[name] += perf() - t0
        N[name] += 1
        if name == "allocate_slots":
            LOOKAHEAD[k.get("num_lookahead_tokens", 0)] += 1
        return out

    setattr(cls, meth, timed)


def capture(llm) -> dict:
    core = llm.llm_engine.engine_core.engine_core
    s = core.scheduler
    # Ours' verifier (the engine's AV manager): each fresh scheduler claims
    # it again, as the engine's own claimed it once (claim_local_verifier).
    return {"cls": type(s), "hasher": core.request_block_hasher,
            "verifier": getattr(s.dynamic_sd_lookup, "verifier", None),
            "kwargs": dict(vllm_config=s.vllm_config, kv_cache_config=s.kv_cache_config,
                           structured_output_manager=s.structured_output_manager,
                           include_finished_set=s.finished_req_ids_dict is not None, log_stats=s.log_stats,
                           block_size=s.block_size, hash_block_size=s.hash_block_size)}


def long_prompt_ids(i: int, n: int) -> list[int]:
    """prompt_ids(i) repeated to n tokens, distinct per request (no prefix hits)."""
    base = prompt_ids(i)
    return [base[j % len(base)] + 50 * (j // len(base) % 4) for j in range(n)]


def sampled(sched, req_id: str) -> list[int]:
    """One token, or none for a request still in its prompt (chunked
    prefill: its computed count, advanced at scheduling, is short of it)."""
    req = sched.requests.get(req_id)
    return [] if req is not None and req.num_computed_tokens < req.num_prompt_tokens else [5]


def drive(arm: dict, concurrency: int, max_tokens: int, tag: str, prompt_len: int = 8) -> dict:
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    if arm["verifier"] is not None:
        from vllm_av.vllm.mrv1.scheduled_depth import register_local_verifier

        register_local_verifier(arm["verifier"])
    sched = arm["cls"](**arm["kwargs"])
    for i in range(concurrency):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(
            request_id=f"{tag}-{i}", prompt_token_ids=long_prompt_ids(i, prompt_len),
            sampling_params=sp, pooling_params=None, block_hasher=arm["hasher"]))
    T.clear(), N.clear(), LOOKAHEAD.clear()
    depths: Counter = Counter()
    spec_tokens = 0
    queue: deque = deque()
    ON["on"] = True
    t0 = time.perf_counter()
    while True:
        if sched.has_requests():
            so = sched.schedule()
            depths[so.num_spec_tokens_to_schedule] += 1
            spec_tokens += sum(len(v) for v in so.scheduled_spec_decode_tokens.values())
            queue.appendleft(so)
            if len(queue) < 2:
                continue
        if not queue:
            break
        so = queue.pop()
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled(sched, r) for r in ids])
        sched.update_from_output(so, out)
    wall = time.perf_counter() - t0
    ON["on"] = False
    steps = N["schedule"]
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps,
            "ms_per_step": {k: v * 1e3 / steps for k, v in T.items()},
            "calls": dict(N), "alloc_us_per_call": T["allocate_slots"] * 1e6 / N["allocate_slots"],
            "lookahead": dict(LOOKAHEAD), "num_spec_tokens_to_schedule": dict(depths),
            "spec_tokens_scheduled": spec_tokens}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV block size (the CPU's default is 128, the H200's 16)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cprofile", type=Path, default=None,
                    help="profile each arm's timed drives into DIR/<arm>_c<C>.pstats")
    opts = ap.parse_args()
    os.environ["VLLM_AV_TEST_CPU_ASYNC"] = "1"
    from conftest import make_llm
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    import vllm_av.vllm.mrv1.scheduled_depth as sd

    wrap(Scheduler, "schedule", "schedule")
    wrap(Scheduler, "update_from_output", "update_from_output")
    wrap(KVCacheManager, "allocate_slots", "allocate_slots")
    wrap(sd.DepthFromVerifier, "__getitem__", "av_depth_lookup")
    models, specs = tiny_pair_at_depth0(Path(tempfile.mkdtemp(prefix="schedpure_")))
    cmax = max(int(c) for c in opts.concurrency.split(","))
    arms = {}
    for name, spec in specs.items():
        extra = {} if opts.block_size is None else {"block_size": opts.block_size}
        llm = make_llm(models, spec=spec, max_num_seqs=cmax, enforce_eager=True,
                       async_scheduling=True,
                       max_model_len=max(256, opts.prompt_len + opts.max_tokens + 16), **extra)
        arms[name] = capture(llm)
        arms[name]["llm"] = llm  # kept alive (its verifier answers ours' depth lookup)
    result = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": f"{os.uname().machine}, {os.cpu_count()} cpus",
              "scheduler_class": {k: a["cls"].__name__ for k, a in arms.items()},
              "runs": []}
    for c in [int(x) for x in opts.concurrency.split(",")]:
        drive(arms["plain"], c, opts.max_tokens, "warm-p", opts.prompt_len)
        drive(arms["ours_depth0"], c, opts.max_tokens, "warm-o", opts.prompt_len)
        profiles = {name: cProfile.Profile() for name in arms} if opts.cprofile else {}
        for rep in range(opts.repeats):
            order = ("plain", "ours_depth0") if rep % 2 == 0 else ("ours_depth0", "plain")
            for name in order:
                if profiles:
                    profiles[name].enable()
                r = drive(arms[name], c, opts.max_tokens, f"{name}-{c}-{rep}", opts.prompt_len)
                if profiles:
                    profiles[name].disable()
                r.update(arm=name, concurrency=c, rep=rep)
                result["runs"].append(r)
                m = r["ms_per_step"]
                print(f"[{name}] C={c} rep{rep}: schedule {m['schedule']:.3f} ufo "
                      f"{m['update_from_output']:.3f} alloc {m['allocate_slots']:.3f} ms/step "
                      f"({r['alloc_us_per_call']:.2f} us/call) lookup {m.get('av_depth_lookup', 0):.3f}"
                      f" depths {r['num_spec_tokens_to_schedule']} spec {r['spec_tokens_scheduled']}",
                      flush=True)
        for name, prof in profiles.items():
            opts.cprofile.mkdir(parents=True, exist_ok=True)
            prof.dump_stats(opts.cprofile / f"{name}_c{c}.pstats")
        if opts.out:
            opts.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
