"""Device operations our V2 path adds to a drafting step, counted (CPU).

    python benchmarks/mrv2_step_launches.py --out benchmarks/results/mrv2_step_launches_cpu.json

On a GPU each device operation is a kernel launch, and at small batches a
launch costs more host time than the device spends on it (about 10-20 us
each on the H200, `benchmarks/mrv2_host_costs.py`), so their number is
what our V2 path adds to a drafting step's host time. This counts them on
the CPU, piece by piece, for one drafting step of `ours_v2` at depth d:
the estimator's observation of the verified drafts (`step`), its
confidences after each of the d draft forwards (`predict`), the depth
patch's prior for the slots not drafted, the manager's record of the
confidences, and its layout of the next verification (all drafts
admitted). Counted with a TorchDispatchMode (every aten operation that is
not a view) plus one per fused Triton kernel launched, which runs under
Triton's interpreter (the script sets TRITON_INTERPRET=1 before anything
imports Triton); `--torch` counts the torch operations the kernels replace.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

if "--torch" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm_av.core.estimator as core_estimator  # noqa: E402
import vllm_av.vllm.mrv2.estimator as mrv2_estimator  # noqa: E402
from vllm_av.core import fused  # noqa: E402
from vllm_av.vllm.config import AVOptions  # noqa: E402
from vllm_av.vllm.mrv2.depth import MRV2DraftDepthPatch  # noqa: E402
from benchmarks.mrv2_depth_overhead import K as OVERHEAD_K, cpu_manager  # noqa: E402

K = OVERHEAD_K  # 7, as the managers cpu_manager builds
VOCAB = 4096  # the count does not depend on it


class Count(TorchDispatchMode):
    """Device operations: aten calls that are not views."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _IN_KERNEL[0]:
            pass  # the interpreter's own tensor handling: one launch, counted apart
        elif not func._schema.is_mutable and any(
                r.alias_info is not None for r in func._schema.returns):
            pass  # a view: no kernel
        else:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


_LAUNCHES = Counter()
_IN_KERNEL = [False]
_launch = fused._launch


def _counting_launch(name, *a, **k):
    _LAUNCHES[name] += 1
    _IN_KERNEL[0] = True
    try:
        return _launch(name, *a, **k)
    finally:
        _IN_KERNEL[0] = False


fused._launch = _counting_launch


class Drafter:
    """The V2 draft-model speculator as far as our depth patch and the
    estimator see it: each draft forward ends in `predict`."""

    propose = MRV2DraftDepthPatch.propose

    def __init__(self, R, est):
        self.num_speculative_steps = K
        self.vllm_config = SimpleNamespace(additional_config={
            "vllm_av": AVOptions(scheduled_depth=True).to_dict()})
        self.draft_tokens = torch.zeros(R, K, dtype=torch.int64)
        self.draft_token_confidence_probs = torch.ones(R, K)
        self.acceptance_estimator = est
        g = torch.Generator().manual_seed(R)
        self.logits = torch.randn(R, VOCAB, generator=g).to(torch.bfloat16)
        self.temperature = torch.ones(R)

    def _orig_propose(self, input_batch, *a, **k):
        for step in range(self.num_speculative_steps):
            self.acceptance_estimator.predict(
                self.logits, input_batch.idx_mapping, torch.tensor(step),
                self.draft_token_confidence_probs, self.temperature)
        return self.draft_tokens


def manager(R, metrics_dir):
    m = cpu_manager(R, metrics_dir)
    # Verification about free: every draft is admitted.
    m.set_cost_curves([(1, [1.0]), (R, [1.0])], [(1, [2.0]), (8 * R + 8, [2.01])])
    for i in range(R):
        m.add_request(i)
    return m


def count(fn) -> dict:
    _LAUNCHES.clear()
    with Count() as c:
        fn()
    return {"torch_ops": sum(c.ops.values()), "fused_kernels": sum(_LAUNCHES.values()),
            "top": dict(c.ops.most_common(6))}


def drafting_step(R: int, depth: int, metrics_dir: str) -> dict:
    est = mrv2_estimator.AcceptanceEstimator(R, K, torch.device("cpu"))
    m = manager(R, metrics_dir)
    drafter = Drafter(R, est)
    ids = [f"r{i}" for i in range(R)]
    idx = torch.arange(R, dtype=torch.int32)
    batch = SimpleNamespace(num_reqs=R, idx_mapping=idx, idx_mapping_np=np.arange(R))
    sampled = torch.full((R,), 2, dtype=torch.int32)
    rejected = torch.full((R,), max(depth - 1, 0), dtype=torch.int32)

    def observe():
        est.verifying = True
        est.step(idx, sampled, rejected)

    def propose():
        drafter.propose(batch, num_speculative_tokens=depth)

    def record():
        m.record_confidences(drafter.draft_token_confidence_probs, batch)

    def layout():
        per_req = {r: 1 + depth for r in ids}
        m.get_num_tokens(per_req, {r: [0] * depth for r in ids})
        nd = np.full(R, depth, dtype=np.int32)
        sched = nd + 1
        m.compact_batch(nd, sched, np.concatenate([[0], np.cumsum(sched)]).astype(np.int32))
        m.reallocate_drafts(ids, idx)

    for _ in range(3):  # warm: the slots' first records, the estimator's first refit
        observe(), propose(), record(), layout()
    pieces = {name: count(fn) for name, fn in
              (("observe", observe), ("propose", propose), ("record", record), ("layout", layout))}
    total = sum(p["torch_ops"] + p["fused_kernels"] for p in pieces.values())
    return {"R": R, "depth": depth, "launches": total, "pieces": pieces}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,64")
    p.add_argument("--depths", default=f"1,3,{K}")
    p.add_argument("--torch", action="store_true",
                   help="count the torch operations the fused kernels replace")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.torch:
        mrv2_estimator.fused_confidences = core_estimator.fused_observe = lambda *a, **k: False
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for R in (int(x) for x in args.sizes.split(",")):
            for d in (int(x) for x in args.depths.split(",")):
                row = drafting_step(R, d, tmp)
                rows.append(row)
                parts = ", ".join(f"{k} {v['torch_ops']}+{v['fused_kernels']}"
                                  for k, v in row["pieces"].items())
                print(f"R={R} depth {d}: {row['launches']} device operations ({parts})")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
              "form": "torch operations" if args.torch else "fused kernels",
              "command": "python benchmarks/mrv2_step_launches.py" + (" --torch" if args.torch else ""),
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
