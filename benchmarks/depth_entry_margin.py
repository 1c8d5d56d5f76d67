"""Trace replay of the drafting-depth policy near break-even, with and
without its entry margin (`DEPTH_ENTRY_MARGIN` in vllm_av/core/verifier.py).

    python benchmarks/depth_entry_margin.py [--steps 3000] [--seeds 0,1,2] \
        [--scales 1.0,1.25,1.5,1.75,2.0] [--out results.json]

An engine at 64 concurrent decoding requests under async scheduling, K = 7,
driven through `AdaptiveVerifier` as the V1 async adapter drives it: each
step `choose_depth` for the batch, then the previous step's outcomes
observed, finished requests forgotten, the step's drafts admitted in full
(async scheduling verifies every draft), and every fourth step of each
kind timed into the cost corrections. Acceptance and features come from
the labelled drafts of the real Qwen2.5-Coder pair (../shared/data/traces);
each request lives 256 steps, one replaced every 4 steps.

Step costs resemble the H200's with that pair (ms): verification 1.9 at 1
token, 4.5 at 64, 6.0 at 512, 85 at 16,128; drafting at depth 7 9 ms at one
request and 34 at 256, at depth 1 1.3 and 4.9; `--scales` multiplies every
drafting cost, moving the replay from "drafting pays" (1.0) through
break-even (about 1.4-1.7) to "it does not" (2.0). For each dataset, scale
and seed: tokens per ms over plain decoding's, the steps that drafted below
K, and the explorations (depth K), with the margin at 0 and at its default.
A planning replay of the policy, not a measurement of an engine.
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

from vllm_av.core.cost_model import CostModel  # noqa: E402
from vllm_av.core.verifier import DEPTH_ENTRY_MARGIN, AdaptiveVerifier  # noqa: E402
from vllm_av.sim.traces import PromptTape, TraceSet  # noqa: E402

K = 7
R = 64
LIFE = 256  # steps each request decodes
TIMING_INTERVAL = 4  # a timed step of each kind (plain, drafting) this often


def build_cost(draft_scale: float) -> CostModel:
    verify = {1: [1.9], 64: [4.5], 512: [6.0], 16128: [85.0]}
    full = {1: [9.0 * draft_scale], 256: [34.0 * draft_scale]}
    one = {1: [1.3 * draft_scale], 256: [34.0 / 7 * draft_scale]}
    cost = CostModel.from_samples(verify, full, graph_sizes=(), draft_by_depth={1: one, K: full})
    cost.free_zero_depth = True  # depth 0 skips the drafter
    return cost


def new_request(tapes: list, rng: np.random.Generator):
    """(acceptance run lengths, features) of one request: real tapes joined
    until they cover a whole life at full depth."""
    labels, feats, bonus, total = [], [], [], 0
    while total < LIFE * (K + 1) + K + 2:
        t = tapes[rng.integers(len(tapes))]
        labels.append(t.labels)
        feats.append(t.features)
        bonus.append(t.bonus_accept)
        total += t.length
    tape = PromptTape("joined", np.concatenate(labels), np.concatenate(feats),
                      np.concatenate(bonus))
    return tape.instantiate(rng, K + 2)


def replay(trace: TraceSet, draft_scale: float, margin: float, steps: int, seed: int) -> dict:
    cost = build_cost(draft_scale)
    v = AdaptiveVerifier(K, cost)
    v.probe_plain_steps = True
    v.depth_entry_margin = margin
    rng = np.random.default_rng(seed)
    ids, runs, feats = [], [], []
    pos = np.zeros(R, np.int64)
    left = np.array([LIFE - (c * LIFE) // R for c in range(R)])  # staggered lives
    for c in range(R):
        run, f = new_request(trace.tapes, rng)
        ids.append(f"r{c}")
        runs.append(run)
        feats.append(f)
    started = R
    drafted_prev: dict[str, int] = {}  # drafts verified this step, by request
    outcomes: dict[str, tuple[int, int]] = {}  # verified last step: (drafted, accepted)
    gone: list[str] = []
    last_timed: dict[bool, int] = {}
    total_ms, emitted, depths = 0.0, 0, []
    explorations = 0
    for s in range(steps):
        d = v.choose_depth(list(ids), num_sampling=R, num_other_tokens=R, may_explore=True)
        explorations += int(d == K and v._since_explore == 0)
        depths.append(d)
        # The runner: last step's outcomes, finished requests, a new step.
        if outcomes:
            rids = list(outcomes)
            v.observe(rids, np.array([outcomes[r][0] for r in rids]),
                      np.array([outcomes[r][1] for r in rids]),
                      learn=np.array([r in ids for r in rids]))
        v.forget(gone)
        v.begin_step()
        gone = []
        # Verify last step's drafts (all of them: async scheduling).
        verified, outcomes = 0, {}
        for c, rid in enumerate(ids):
            n = drafted_prev.get(rid, 0)
            acc = int(min(n, runs[c][pos[c]])) if n else 0
            if n:
                outcomes[rid] = (n, acc)
            verified += n
            pos[c] += acc + 1
            emitted += acc + 1
        verify_ms = float(cost.verify(R + verified))
        draft_ms = float(cost.draft_cost_at_depth(R, d, K))
        total_ms += verify_ms + draft_ms
        plain = verified == 0
        if s + 1 - last_timed.get(plain, 0) >= TIMING_INTERVAL:
            last_timed[plain] = s + 1
            v.observe_verify_time(R + verified, verify_ms, plain=plain)
            if d > 0:
                v.observe_draft_time(d, R, draft_ms)
        drafted_prev = {}
        if d > 0:
            f = np.stack([feats[c][pos[c]:pos[c] + K] for c in range(R)]).astype(np.float32)
            v.admit(list(ids), torch.from_numpy(f), np.full(R, d, dtype=np.int64), R, R,
                    admit_all=True)
            drafted_prev = {rid: d for rid in ids}
        left -= 1
        for c in np.flatnonzero(left <= 0):
            gone.append(ids[c])
            drafted_prev.pop(ids[c], None)
            runs[c], feats[c] = new_request(trace.tapes, rng)
            ids[c], pos[c], left[c] = f"r{started}", 0, LIFE
            started += 1
    depths = np.array(depths)
    plain_rate = R / float(cost.verify(R))
    return {"over_plain": emitted / total_ms / plain_rate,
            "steps_below_k": int(((depths > 0) & (depths < K)).sum()),
            "explorations": explorations}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--scales", default="1.0,1.25,1.5,1.75,2.0")
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "data" / "traces")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--explore-share", type=float,
                    help="what-if: the share of time ours' depth policy may spend exploring "
                         "(EXPLORE_MAX_TIME_SHARE in vllm_av/core/verifier.py, default 0.05)")
    args = ap.parse_args()
    if args.explore_share is not None:
        import vllm_av.core.verifier as verifier

        verifier.EXPLORE_MAX_TIME_SHARE = args.explore_share
    torch.set_num_threads(1)
    datasets = [d for d in ("mtbench", "humaneval") if (args.traces / f"traces_{d}.npz").exists()]
    if not datasets:
        raise SystemExit(f"no traces_<dataset>.npz under {args.traces}")
    seeds = [int(x) for x in args.seeds.split(",")]
    scales = [float(x) for x in args.scales.split(",")]
    t0 = time.time()
    rows = []
    for ds in datasets:
        trace = TraceSet.from_npz(args.traces / f"traces_{ds}.npz")
        for scale in scales:
            row = {"dataset": ds, "draft_scale": scale}
            for label, margin in (("no_margin", 0.0), ("margin", DEPTH_ENTRY_MARGIN)):
                runs = [replay(trace, scale, margin, args.steps, seed) for seed in seeds]
                row[label] = {"over_plain_median": statistics.median(r["over_plain"] for r in runs),
                              "runs": runs}
            rows.append(row)
            print(f"{ds:9s} drafting x{scale:<4} over plain: no margin "
                  f"{row['no_margin']['over_plain_median']:.4f}, margin {DEPTH_ENTRY_MARGIN} "
                  f"{row['margin']['over_plain_median']:.4f}; steps below K "
                  f"{[r['steps_below_k'] for r in row['no_margin']['runs']]} -> "
                  f"{[r['steps_below_k'] for r in row['margin']['runs']]}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
            "steps": args.steps, "seeds": seeds, "margin": DEPTH_ENTRY_MARGIN,
            "explore_share": args.explore_share,
            "seconds": round(time.time() - t0, 1), "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
