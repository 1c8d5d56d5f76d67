"""Step-cost tables for the simulator, and drafting cost by depth.

Every table is a `vllm_av.core.cost_model.CostModel` (what the shipped
policy reads), with the same meaning as the start-up profile
(vllm_av/vllm/mrv1/startup.py): `verify_cost(n)` is a target forward over n
tokens, `draft_cost(r)` is one drafting step of `r` requests at the
profiled depth K (K forward passes of the drafter, one token per request
each). The simulator charges a step

    sum_{j < K} fwd(#requests drafting at depth > j) + verify_cost(tokens),
    fwd(r) = draft_cost(r) / K, fwd(0) = 0,

so a policy that drafts fewer tokens, or fewer requests deep, pays less.

Tables (assumptions in docs/simulator.md):
- `h200_design`: DESIGN.md section 1's H200 measurements. Target: the 8B
  stack (4.4 ms at 1 token, 4.7 at 64, 7.0 at 256, 12.1 at 512, linear past
  it with the 256..512 slope). Drafter: the 1B stack, one forward per depth
  (0.86 ms at 1 request, 0.98 at 64, 1.35 at 256, 2.16 at 512, 4.0 at 1024).
  Linear between measured points (no staircase: the points are not the
  capture sizes).
- `h200_eagle`: the same target with an EAGLE-style drafter (one decoder
  layer plus the lm_head, ~0.4 ms per forward at one request): the 1B
  drafter's curve scaled by EAGLE_SCALE. An assumption, not a measurement:
  it shows the regime AV was designed for, where verification, not
  drafting, dominates the step.
- `large_deployment`: an 8-GPU MoE deployment of a DeepSeek-V4-class model,
  from a roofline, not a measurement: 8 ms fixed per step (launches,
  all-to-all, 60 layers of collectives), weight reads of 4 ms (attention,
  dense, shared experts) plus 13 ms of routed experts scaled by the fraction
  of experts touched (256 experts, top-8), and 0.03 ms per token of compute
  (about 37B active parameters at ~2.5 PFLOP/s effective over 8 GPUs):
  verify(n) = 8 + max(4 + 13 * (1 - (1 - 8/256)^n), 0.03 n) ms, knee near
  570 tokens. Drafter: an MTP layer, 1.2 ms + 0.0005 ms per request per
  forward.
- `cpu_mlp`: measured here, eagerly, with two small torch MLP stacks (see
  `measure_cpu_mlp`).
"""

from __future__ import annotations

import time

import numpy as np

from vllm_av.core.cost_model import CostModel

# Sizes at which the synthetic tables are sampled (interpolated in between).
_SYNTH_SIZES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                3072, 4096]

# DESIGN.md section 1, H200, dense bf16 decoder stacks with CUDA graphs (ms).
H200_8B = {1: 4.4, 64: 4.7, 256: 7.0, 512: 12.1}
H200_1B = {1: 0.86, 64: 0.98, 256: 1.35, 512: 2.16, 1024: 4.0}


def h200_design(K: int = 7) -> CostModel:
    verify = {n: [ms] for n, ms in H200_8B.items()}
    draft = {n: [K * ms] for n, ms in H200_1B.items()}
    return CostModel.from_samples(verify, draft, graph_sizes=[])


# One 8B decoder layer (~1/32 of 4.4 ms) + a 128k x 4096 lm_head read
# (~0.25 ms at 4 TB/s) + launches: ~0.4 ms, 0.45 of the 1B stack at 1 token.
EAGLE_SCALE = 0.45


def h200_eagle(K: int = 7) -> CostModel:
    verify = {n: [ms] for n, ms in H200_8B.items()}
    draft = {n: [K * EAGLE_SCALE * ms] for n, ms in H200_1B.items()}
    return CostModel.from_samples(verify, draft, graph_sizes=[])


def large_deployment(K: int = 7) -> CostModel:
    n = np.asarray(_SYNTH_SIZES, dtype=np.float64)
    experts_touched = 1.0 - (1.0 - 8.0 / 256.0) ** n
    verify_ms = 8.0 + np.maximum(4.0 + 13.0 * experts_touched, 0.03 * n)
    draft_ms = K * (1.2 + 0.0005 * n)
    return CostModel.from_samples(
        {int(s): [v] for s, v in zip(n, verify_ms)},
        {int(s): [v] for s, v in zip(n, draft_ms)},
        graph_sizes=[],
    )


def measure_cpu_mlp(K: int = 7, max_tokens: int = 512, repeats: int = 3, seed: int = 0):
    """Time two MLP stacks eagerly on this CPU; returns a CostModel.

    Target: 4 blocks of Linear(768, 3072) -> GELU -> Linear(3072, 768)
    (19M fp32 parameters, 75 MB: past the caches, so small batches are bound
    by memory bandwidth and large ones by compute, like a real model on a
    CPU). Drafter: 2 blocks at width 384 (2.4M parameters). One thread: on a
    shared, oversubscribed machine torch's thread pool made a 1-token
    forward 6x slower than single-threaded, and erratically so. Each sample
    is the fastest of 2 calls (a shared machine's preemptions only ever add
    time), the table keeps the median of `repeats` samples per size; past
    `max_tokens` the cost model extrapolates linearly, which is what a
    compute-bound CPU does. The draft table is K forwards. No attention and
    no KV cache: this prices the token-count dependence only.
    """
    import torch

    torch.manual_seed(seed)

    def stack(width: int, blocks: int):
        layers = []
        for _ in range(blocks):
            layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                       torch.nn.Linear(4 * width, width)]
        return torch.nn.Sequential(*layers).eval()

    target, drafter = stack(768, 4), stack(384, 2)

    def timed(model, width, n):
        x = torch.randn(n, width)
        model(x)  # warm-up
        samples = []
        for _ in range(repeats):
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                model(x)
                best = min(best, time.perf_counter() - t0)
            samples.append(best * 1e3)
        return samples

    sizes, n = [], 1
    while n <= max_tokens:
        sizes.append(n)
        n *= 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            verify = {s: timed(target, 768, s) for s in sizes}
            draft = {s: [K * t for t in timed(drafter, 384, s)] for s in sizes}
    finally:
        torch.set_num_threads(threads)
    return CostModel.from_samples(verify, draft, graph_sizes=[])


class StepCost:
    """Charges a simulated step: drafting by depth, verification by tokens."""

    def __init__(self, model: CostModel, K: int):
        self.model = model
        self.K = K  # depth the draft table was profiled at

    def draft_fwd(self, num_reqs):
        """One drafter forward over `num_reqs` requests (0 requests cost 0)."""
        n = np.asarray(num_reqs, dtype=np.float64)
        return np.where(n > 0, self.model.draft_cost(np.maximum(n, 1.0)) / self.K, 0.0)

    def draft_ms(self, drafted: np.ndarray) -> float:
        """drafted: [R] depth per request -> ms for the drafting step."""
        depth = int(drafted.max()) if drafted.size else 0
        if depth == 0:
            return 0.0
        levels = (drafted[:, None] > np.arange(depth)).sum(0)  # [depth]
        return float(self.draft_fwd(levels).sum())

    def verify_ms(self, num_tokens):
        return self.model.verify_cost(num_tokens)

    def overhead_ms(self, drafted: np.ndarray) -> float:
        """Per-step cost outside the two forwards (scheduler, sampler,
        bookkeeping), given the step's [R] drafted depths. 0 here: the
        built-in tables price the forwards only; a subclass built from a
        measured step breakdown charges it
        (benchmarks/validate_simulator.py)."""
        return 0.0


__all__ = [
    "StepCost",
    "h200_design",
    "h200_eagle",
    "large_deployment",
    "measure_cpu_mlp",
]
