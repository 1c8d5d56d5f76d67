"""How many times admission waits for the GPU per drafting step.

    python benchmarks/admission_syncs.py --out benchmarks/results/admission_syncs_h200.json

Core only (no vLLM): an `AdaptiveVerifier` on CUDA tensors, R requests x
K=7 drafted token ids and features on the device, a cost table under which
the budget trims. Each step: `begin_step`, `observe` of the previous
admission (host numbers, as the V1 adapter passes them), then admission,
under `torch.cuda.set_sync_debug_mode("warn")`, counting the synchronising
calls it reports (and, apart, those of `begin_step` + `observe`), in two
forms:

  together:  `admit_fetching(..., fetch=drafts)`: admitted counts, scores
             and the drafted token ids in one transfer (the V1 adapter);
  separate:  `admit(...)` then `drafts.tolist()` (how the adapter fetched
             them before: the control, which must count more).

A host scheduler (vLLM's V1 runner, synchronous) needs the token ids on
the host each drafting step, so one wait per step is the engine's own; the
`together` form adds none to it. Exit status 1 when `together` waits more
than once per step after the first.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_av.core.cost_model import CostModel  # noqa: E402
from vllm_av.core.verifier import AdaptiveVerifier  # noqa: E402

K = 7


def count_syncs(fn) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run(form: str, R: int, steps: int, seed: int = 0) -> list[int]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    # Verification costs 1 ms up to R tokens, then grows: the budget trims.
    cost = CostModel.from_samples({1: [1.0], R: [1.0], 8 * R: [8.0]}, {1: [0.0]})
    v = AdaptiveVerifier(K, cost)
    ids = [f"r{i}" for i in range(R)]
    drafted = np.full(R, K, dtype=np.int64)
    counts, observe_counts, admitted = [], [], None
    for _ in range(steps):
        drafts = torch.randint(0, 150_000, (R, K), device=dev, generator=g)
        feats = torch.randn(R, K, device=dev, generator=g) * 2 + 1
        torch.cuda.synchronize()
        if admitted is not None:
            def learn(a=admitted):
                v.begin_step()
                v.observe(ids, a, np.minimum(a, 1))
            observe_counts.append(count_syncs(learn))

        def step():
            nonlocal admitted
            if form == "together":
                admitted, rows = v.admit_fetching(ids, feats, drafted, R, R, fetch=drafts)
                rows.tolist()
            else:
                admitted = v.admit(ids, feats, drafted, R, R)
                drafts.tolist()

        counts.append(count_syncs(step))
    run.observe_counts = observe_counts  # the learning side, for the report
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    rows = []
    for R in [int(c) for c in args.concurrency.split(",")]:
        for form in ("together", "separate"):
            c = run(form, R, args.steps)
            obs = run.observe_counts
            rows.append({"R": R, "form": form, "syncs_first_step": c[0],
                         "syncs_per_step_after": c[1:], "max_after_first": max(c[1:]),
                         "observe_syncs_per_step": obs})
            print(f"[admission-syncs] R={R} {form}: first step {c[0]}, then "
                  f"{sorted(set(c[1:]))} per step; begin_step + observe "
                  f"{sorted(set(obs))} per step", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "K": K, "steps": args.steps, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = all(r["max_after_first"] <= 1 for r in rows if r["form"] == "together")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
