"""What the exploration backoff's cap costs and saves: a replay of the
drafting-depth policy (`AdaptiveVerifier.choose_depth`) with
`EXPLORE_BACKOFF_MAX` (and `EXPLORE_BACKOFF_FACTOR`) at several values.

    python benchmarks/exploration_backoff.py [--caps 8,32] [--factors 2] [--steps 20000] \
        [--seeds 0,1,2] [--out results.json]

Two batch sizes with step costs as the H100 measured them with the real
Qwen2.5-Coder pair (thirty-sixth round, ms): a plain step 2.3 at one
request and 4.7 at 64, a full-depth (K = 7) drafting step 5.5 and 5.0
more (an exploring batch's GPU span grew by 10-19 ms over its two
exploring steps), depth 1 a seventh of that. Each draft is accepted with
probability `p` at every position (its feature the logit of p plus noise).

* steady: p = 0.2 for the whole run, where drafting does not pay, so the
  policy stays at depth 0 and drafts only to explore: the share of the
  run's time its exploring steps add over plain steps.
* change: p = 0.2, then 0.9 from step `--change-at` on, where depth 1
  and more pay: the steps from the change to the first step the policy
  itself drafts (exploration is what shows it the change).

A planning replay of the policy with measured costs, not a measurement
of an engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import vllm_av.core.verifier as verifier_module  # noqa: E402
from vllm_av.core.cost_model import CostModel  # noqa: E402
from vllm_av.core.verifier import AdaptiveVerifier  # noqa: E402

K = 7
# batch size -> (plain step ms, verification of 8 tokens per request ms,
# drafting at depth K ms, at depth 1 ms)
COSTS = {1: (2.3, 2.35, 5.5, 5.5 / 7), 64: (4.7, 6.0, 5.0, 5.0 / 7)}
P_LOW, P_HIGH = 0.2, 0.9


def build_cost(R: int) -> CostModel:
    plain, full_verify, draft_k, draft_1 = COSTS[R]
    verify = {R: [plain], R * (K + 1): [full_verify]}
    cost = CostModel.from_samples(verify, {R: [draft_k]}, graph_sizes=(),
                                  draft_by_depth={1: {R: [draft_1]}, K: {R: [draft_k]}})
    cost.free_zero_depth = True  # depth 0 skips the drafter
    return cost


def replay(R: int, steps: int, seed: int, change_at: int | None) -> dict:
    cost = build_cost(R)
    v = AdaptiveVerifier(K, cost)
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(R)]
    total_ms = explore_extra_ms = 0.0
    explorations = 0
    first_drafting_after_change = None
    plain_ms = float(cost.verify(R))
    for s in range(steps):
        p = P_HIGH if change_at is not None and s >= change_at else P_LOW
        d = v.choose_depth(ids, num_sampling=R, num_other_tokens=R)
        exploring = d == K and v._since_explore == 0
        explorations += int(exploring)
        if (d > 0 and not exploring and change_at is not None and s >= change_at
                and first_drafting_after_change is None):
            first_drafting_after_change = s - change_at
        step_ms = plain_ms
        if d > 0:
            logit = np.log(p / (1 - p))
            feats = torch.from_numpy(rng.normal(logit, 0.5, size=(R, K)).astype(np.float32))
            admitted = v.admit(ids, feats, np.full(R, d), R, R)
            v.begin_step()
            # Accepted drafts: a run of successes of probability p, cut at
            # the admitted count.
            runs = np.argmax(rng.random((R, K + 1)) > p, axis=1)
            v.observe(ids, admitted, np.minimum(admitted, runs))
            step_ms = float(cost.verify(R + int(admitted.sum()))) + float(
                cost.draft_cost_at_depth(R, d, K))
        total_ms += step_ms
        if exploring:
            explore_extra_ms += step_ms - plain_ms
    return {"explorations": explorations, "explore_share": explore_extra_ms / total_ms,
            "steps_to_draft_after_change": first_drafting_after_change}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="8,32")
    ap.add_argument("--factors", default="2", help="the back-off's growth per exploration")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--change-at", type=int, default=10000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = [int(x) for x in args.seeds.split(",")]
    default_cap = verifier_module.EXPLORE_BACKOFF_MAX
    default_factor = verifier_module.EXPLORE_BACKOFF_FACTOR
    t0 = time.time()
    rows = []
    for cap, factor in [(int(c), int(f)) for c in args.caps.split(",")
                        for f in args.factors.split(",")]:
        verifier_module.EXPLORE_BACKOFF_MAX = cap
        verifier_module.EXPLORE_BACKOFF_FACTOR = factor
        for R in COSTS:
            steady = [replay(R, args.steps, seed, None) for seed in seeds]
            change = [replay(R, args.steps, seed, args.change_at) for seed in seeds]
            delays = [r["steps_to_draft_after_change"] for r in change]
            row = {"cap": cap, "factor": factor, "requests": R,
                   "explore_share_median": statistics.median(r["explore_share"] for r in steady),
                   "explorations": [r["explorations"] for r in steady],
                   "steps_to_draft_after_change": delays, "steady": steady, "change": change}
            rows.append(row)
            ms = COSTS[R][0]
            print(f"cap {cap:3d}, factor {factor}, {R:3d} requests: exploring adds "
                  f"{100 * row['explore_share_median']:.2f}% of the time where drafting does "
                  f"not pay ({row['explorations']} explorations in {args.steps} steps); after "
                  f"drafting starts to pay the policy drafts {delays} steps later "
                  f"(about {[round(x * ms / 1e3, 1) if x is not None else None for x in delays]} s "
                  f"at {ms} ms a step)", flush=True)
    verifier_module.EXPLORE_BACKOFF_MAX = default_cap
    verifier_module.EXPLORE_BACKOFF_FACTOR = default_factor
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
            "steps": args.steps, "change_at": args.change_at, "seeds": seeds,
            "costs_ms": {str(k): v for k, v in COSTS.items()},
            "seconds": round(time.time() - t0, 1), "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
