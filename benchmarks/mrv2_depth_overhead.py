"""Host time of our per-step work on a Model Runner V2 depth-0 step (CPU).

    python benchmarks/mrv2_depth_overhead.py --out benchmarks/results/mrv2_depth_overhead_cpu.json

What a depth-0 step of `ours_v2` adds on the host beside vLLM's own work:
the scheduler's depth choice (`AVManager.choose_depth`, as
`DepthFromVerifier` calls it, in the depth-0 regime where every row is the
prior), the skipped drafter's early return and the manager's early return
in `record_confidences`. Timed on CPU tensors with a cost table where
drafting never pays, so every step chooses depth 0; median of repeated
runs per batch size.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from types import SimpleNamespace

import numpy as np
import torch

from vllm_av.vllm.config import AVOptions
from vllm_av.vllm.mrv1.scheduled_depth import DepthFromVerifier, register_local_verifier
from vllm_av.vllm.mrv2.depth import MRV2DraftDepthPatch, note_propose
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator
from vllm_av.vllm.mrv2.manager import AVManager

K = 7


class _Drafter:
    propose = MRV2DraftDepthPatch.propose

    def __init__(self, R):
        self.num_speculative_steps = K
        self.vllm_config = SimpleNamespace(additional_config={
            "vllm_av": AVOptions(scheduled_depth=True).to_dict()})
        self.draft_tokens = torch.zeros(R, K, dtype=torch.int64)

    def _orig_propose(self, *a, **k):  # never reached at depth 0
        raise AssertionError("drafter ran at depth 0")


def cpu_manager(R, metrics_dir, device="cpu") -> AVManager:
    """An MRV2 AVManager on CPU tensors (or `device`'s) over R decoding
    requests r0..r{R-1} (slots 0..R-1, prompts done), adaptive depth on; no
    cost tables yet."""
    rs = SimpleNamespace(
        num_speculative_steps=K, device=torch.device(device), max_num_reqs=R,
        max_num_batched_tokens=8192, req_id_to_index={f"r{i}": i for i in range(R)},
        num_computed_tokens_np=np.full(R, 100, dtype=np.int32),
        prefill_len=SimpleNamespace(np=np.full(R, 10, dtype=np.int32)))
    return AVManager(rs, torch.zeros(R + 1, dtype=torch.int32, device=device), num_bonus_tokens=1,
                     max_total_logits=1 << 20,
                     options=AVOptions(metrics_dir=metrics_dir, scheduled_depth=True))


def _manager(R, metrics_dir):
    m = cpu_manager(R, metrics_dir)
    # The H200's part-2 table in shape: a 1.9 ms one-token step, 170 ms drafting.
    m.set_cost_curves([(1, [170.0]), (256, [171.0])], [(1, [1.9]), (256, [20.0]), (2048, [45.0])])
    return m


def time_step(R: int, steps: int, metrics_dir: str, landed: bool = False,
              estimator: bool = True) -> dict:
    # Without one the manager's prior is all ones (an engine whose drafter
    # built no estimator).
    est = AcceptanceEstimator(R, K, torch.device("cpu")) if estimator else None
    m = _manager(R, metrics_dir)
    drafter = _Drafter(R)
    ids = [f"r{i}" for i in range(R)]
    batch = SimpleNamespace(num_reqs=R, idx_mapping=torch.arange(R), idx_mapping_np=np.arange(R))
    if landed:
        # As served after an exploration: two drafting steps recorded, so the
        # depth choice reads a landed host copy (the prior row included).
        for _ in range(2):
            note_propose(False)
            m.record_confidences(torch.full((R, K), 0.5), batch)
    choose, rest = [], []
    # The scheduler's whole lookup (DepthFromVerifier: the scan of the
    # running requests, then the manager), over R decoding requests.
    register_local_verifier(m)
    scheduler = SimpleNamespace(num_spec_tokens=K, running=[
        SimpleNamespace(request_id=r, is_prefill_chunk=False, num_computed_tokens=100,
                        num_prompt_tokens=10, sampling_params=SimpleNamespace(seed=None))
        for r in ids])
    lookup = DepthFromVerifier(scheduler)
    lookups = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lookup[R]
        lookups.append(time.perf_counter() - t0)
    for _ in range(steps):
        t0 = time.perf_counter()
        d = m.choose_depth(ids, num_sampling=R, num_other_tokens=R)
        t1 = time.perf_counter()
        if d == 0:
            drafter.propose(batch, num_speculative_tokens=0)
            m.record_confidences(None, batch)
            t2 = time.perf_counter()
            choose.append(t1 - t0)
            rest.append(t2 - t1)
    del est
    return {"R": R, "landed_record": landed, "depth0_steps": len(choose), "steps": steps,
            "choose_depth_us_median": 1e6 * float(np.median(choose)),
            "choose_depth_us_p99": 1e6 * float(np.percentile(choose, 99)),
            # The mean carries the metrics snapshot written every 16 ticks.
            "choose_depth_us_mean": 1e6 * float(np.mean(choose)),
            "propose_and_record_us_median": 1e6 * float(np.median(rest)),
            "scheduler_lookup_us_median": 1e6 * float(np.median(lookups))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,16,64,256")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", default=None)
    p.add_argument("--without-estimator", action="store_true",
                   help="no estimator built: the manager's prior is all ones")
    args = p.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for R in (int(x) for x in args.sizes.split(",")):
            for landed in (False, True):
                row = time_step(R, args.steps, tmp, landed, not args.without_estimator)
                rows.append(row)
                where = " after a record" if landed else ""
                print(f"R={R}{where}: depth 0 on {row['depth0_steps']}/{row['steps']} steps; "
                      f"choose_depth median {row['choose_depth_us_median']:.1f} us, mean "
                      f"{row['choose_depth_us_mean']:.1f} (p99 "
                      f"{row['choose_depth_us_p99']:.1f}); propose + record "
                      f"{row['propose_and_record_us_median']:.1f} us; the scheduler's lookup "
                      f"{row['scheduler_lookup_us_median']:.1f} us")
    register_local_verifier(None)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "command": "python benchmarks/mrv2_depth_overhead.py",
              "estimator": not args.without_estimator, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
