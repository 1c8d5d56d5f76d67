"""Start-up: profile step costs on the V1 runner and build the verifier.

Verification cost is timed as a target-only dummy step at each token count
(the drafter's part of vLLM's dummy step is switched off while timing);
drafting cost as the drafter's own dummy step (K forward passes) at each
request count, and, with adaptive drafting depth, also at depth 1 (one
forward: what a step of depth 0 or 1 costs, since vLLM's drafter runs its
first forward even when it drafts nothing, to keep its KV cache in sync).
Each size is run once to warm up, then `profile_repeats` times; the cost
model keeps the median. On the CPU there are no CUDA
graphs, so the table has no graph sizes and is interpolated throughout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from vllm_av.core.cost_model import CostModel
from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.verifier import AdaptiveVerifier
from vllm_av.vllm.config import AVOptions

logger = logging.getLogger("vllm.vllm_av")

# Where to write the profiled cost tables as JSON (for the simulator, for
# inspection, or to load later through VLLM_AV_COST_TABLE), if set.
ENV_COST_OUT = "VLLM_AV_COST_TABLE_OUT"


def _sizes(limit: int) -> list[int]:
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    sizes.append(limit)
    return sizes


def sync_device(device) -> None:
    """Wait for `device` when it is a GPU (timings on the host need it)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, repeats: int, device) -> list[float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        sync_device(device)
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


@contextlib.contextmanager
def drafter_depth(drafter, depth: int):
    """Make the drafter propose (and its dummy step run) `depth` forwards
    deep; a drafter without a depth setting is left as it is."""
    saved = getattr(drafter, "num_speculative_tokens", None)
    if saved is None:
        yield
        return
    drafter.num_speculative_tokens = depth
    try:
        yield
    finally:
        drafter.num_speculative_tokens = saved


@contextlib.contextmanager
def _drafter_off(runner):
    """Make vLLM's dummy step run the target only."""
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "dummy_run"):
        yield
        return
    drafter.dummy_run = lambda *a, **k: None
    try:
        yield
    finally:
        del drafter.dummy_run  # back to the class method


def _profile_sizes(runner, options: AVOptions) -> tuple[list[int], list[int]]:
    """Token counts to time: every CUDA-graph capture size plus a few above
    the largest (GPU), or powers of two (CPU, eager)."""
    sched = runner.vllm_config.scheduler_config
    limit = min(options.profile_max_tokens, sched.max_num_batched_tokens)
    comp = runner.vllm_config.compilation_config
    graphs = sorted(
        n for n in (comp.cudagraph_capture_sizes or [])
        if n <= sched.max_num_batched_tokens
    )
    if graphs and not runner.vllm_config.model_config.enforce_eager:
        top = graphs[-1]
        above = [min(int(top * f), sched.max_num_batched_tokens) for f in (1.5, 2, 3)]
        return sorted(set(graphs + above)), graphs
    return _sizes(limit), []


def profile_costs(runner, options: AVOptions) -> CostModel:
    sched = runner.vllm_config.scheduler_config
    device = getattr(runner, "device", None)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    sizes, graph_sizes = _profile_sizes(runner, options)
    max_reqs = min(sched.max_num_seqs, sizes[-1])
    context = min(options.profile_context_len, runner.vllm_config.model_config.max_model_len)

    with_context = on_gpu

    def target_step(n: int) -> None:
        nonlocal with_context
        if with_context:
            # Attention over a synthetic context, as decode steps see it.
            try:
                runner._dummy_run(n, force_attention=True, profile_seq_lens=context)
                return
            except Exception as e:  # an attention backend may refuse it
                logger.warning("vllm-av: profiling without synthetic context (%s)", e)
                with_context = False
        runner._dummy_run(n)

    verify: dict[int, list[float]] = {}
    draft: dict[int, list[float]] = {}
    draft_by_depth: dict[int, dict[int, list[float]]] = {}
    with torch.inference_mode():
        with _drafter_off(runner):
            for n in sizes:
                verify[n] = _time_ms(lambda: target_step(n), options.profile_repeats, device)
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and hasattr(drafter, "dummy_run"):
            req_sizes = [s for s in sizes if s <= max_reqs] or [1]

            def time_drafting() -> dict[int, list[float]]:
                return {
                    n: _time_ms(
                        lambda: drafter.dummy_run(n, use_cudagraphs=on_gpu),
                        options.profile_repeats,
                        device,
                    )
                    for n in req_sizes
                }

            draft = time_drafting()
            K = getattr(drafter, "num_speculative_tokens", None)
            if options.adaptive_depth and isinstance(K, int) and K > 1:
                with drafter_depth(drafter, 1):
                    draft_by_depth = {1: time_drafting(), K: draft}
        else:
            # Model-free drafters (ngram, suffix) run on the CPU beside the
            # step; their cost is small and not a function of the budget.
            draft = {1: [0.0]}
    return CostModel.from_samples(
        verify, draft, graph_sizes=graph_sizes, draft_by_depth=draft_by_depth
    )


def build_verifier(runner, options: AVOptions) -> AdaptiveVerifier:
    t0 = time.perf_counter()
    if options.cost_table:
        with open(options.cost_table) as f:
            cost = CostModel.from_json(f.read())
    else:
        cost = profile_costs(runner, options)
    cost.free_zero_depth = options.adaptive_depth and options.zero_depth_skips_drafter
    spec = runner.vllm_config.speculative_config
    K = spec.num_speculative_tokens
    verifier = AdaptiveVerifier(
        K, cost, OnlineAcceptanceEstimator(K, refit_interval=options.refit_interval)
    )
    # Where steps are timed and zero-draft steps run plain, let depth 0 be
    # probed so that the plain verification table gets measured.
    verifier.probe_plain_steps = bool(
        options.calibrate_costs and options.adaptive_depth and options.plain_zero_draft_steps)
    logger.info(
        "vllm-av: adaptive verification ready (K=%d, method=%s, adaptive depth %s); "
        "cost %s in %.1f s: %s",
        K, spec.method, "on" if options.adaptive_depth else "off",
        "loaded" if options.cost_table else "profiled",
        time.perf_counter() - t0, cost.summary(),
    )
    path = os.environ.get(ENV_COST_OUT)
    if path:
        with open(path, "w") as f:
            f.write(cost.to_json())
    return verifier
