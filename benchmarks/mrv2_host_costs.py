"""Host cost and host waits of the per-step pieces our V2 path adds.

    python benchmarks/mrv2_host_costs.py --out benchmarks/results/mrv2_host_costs_h200.json

Core only (no vLLM; the device's own torch does): on one GPU,
  * waits: how many synchronising calls `torch.cuda.set_sync_debug_mode`
    reports for the verify layout's prefix sums, in the form the V2 manager
    used (`torch.cumsum` into a slice of a persistent buffer) and in the
    form it uses now (`DevicePrefixSums`), and for the estimator's
    `predict` and `step`;
  * host time: wall time of the host per call (launch only: no synchronize
    inside the timed loop) and device time (CUDA events) of the
    estimator's `predict` (once per draft position) and `step` (once per
    drafting step), each as one Triton kernel (`vllm_av.core.fused`, what
    serves) and
    as the torch operations it replaces (`_torch`), of
    `prior_confidences` (once per drafting step, by the V2 manager), and of
    the V2 manager's two per-step pieces: its record of the confidences
    (`manager_record`: one copy to the host on a side stream) and the
    layout of a step whose drafts are all verified (`manager_layout`: the
    budget on the host, then one copy to the device and one into
    query_start_loc), at R = 1, 16, 64, 256 requests, K = 7, the real
    pair's vocabulary (151,936) in bfloat16. The record waits once by
    design, on the event of the copy it started a step earlier (done by
    then in a served step); anything more is a wait to remove.

On an idle GPU a piece that launches faster than the device runs it costs
nothing at small R; inside a served step at C = 1, where the GPU waits on
the host, its host time is added to the step.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_av.core.selector import DevicePrefixSums  # noqa: E402
import vllm_av.core.estimator as core_estimator  # noqa: E402
from benchmarks.admission_syncs import count_syncs  # noqa: E402
from benchmarks.mrv2_depth_overhead import cpu_manager  # noqa: E402
import vllm_av.vllm.mrv2.estimator as mrv2_estimator  # noqa: E402
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator  # noqa: E402

K = 7
VOCAB = 151_936
MAX_REQS = 256


def count_waits(fn) -> int:
    """Synchronising calls `fn` makes, as torch's sync debug mode reports
    them, with nothing of earlier calls still in flight."""
    torch.cuda.synchronize()
    n = count_syncs(fn)
    torch.cuda.synchronize()
    return n


def cumsum_into(counts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The form the V2 manager used before DevicePrefixSums."""
    n = counts.shape[0]
    out[0] = 0
    torch.cumsum(counts, dim=0, dtype=out.dtype, out=out[1 : n + 1])
    return out[: n + 1]


def unfused(fn):
    """`fn` with the fused kernels switched off: the torch operations."""
    def run():
        saved = mrv2_estimator.fused_confidences, core_estimator.fused_observe
        mrv2_estimator.fused_confidences = core_estimator.fused_observe = lambda *a, **k: False
        try:
            fn()
        finally:
            mrv2_estimator.fused_confidences, core_estimator.fused_observe = saved
    return run


def timed(fn, reps: int) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    return {"host_ms": round(host_ms, 4), "device_ms": round(start.elapsed_time(end) / reps, 4)}


def manager_pieces(R: int, dev: torch.device, metrics_dir: str):
    """(record, layout) of a V2 manager on `dev` over R requests, with costs
    under which every draft is verified."""
    from types import SimpleNamespace

    import numpy as np

    m = cpu_manager(R, metrics_dir, device=dev)
    m.set_cost_curves([(1, [1.0]), (R, [1.0])], [(1, [2.0]), (8 * R + 8, [2.0])])
    ids = [f"r{i}" for i in range(R)]
    idx = torch.arange(R, dtype=torch.int32, device=dev)
    batch = SimpleNamespace(num_reqs=R, idx_mapping=idx, idx_mapping_np=np.arange(R))
    probs = torch.full((R, K), 0.7, device=dev)
    drafts = np.full(R, K, dtype=np.int32)
    per_req = {r: 1 + K for r in ids}
    draft_ids = {r: [0] * K for r in ids}
    cu = np.concatenate([[0], np.cumsum(drafts + 1)]).astype(np.int32)

    def record():
        m.record_confidences(probs, batch)

    def layout():
        m.get_num_tokens(per_req, draft_ids)
        m.compact_batch(drafts, drafts + 1, cu)
        m.reallocate_drafts(ids, idx)

    return record, layout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = []
    for R in (1, 16, 64, 256):
        g = torch.Generator(device=dev).manual_seed(R)
        counts = torch.randint(0, K + 2, (R,), device=dev, dtype=torch.int32, generator=g)
        buf = torch.zeros(MAX_REQS + 1, dtype=torch.int32, device=dev)
        sums = DevicePrefixSums(MAX_REQS, dev)
        est = AcceptanceEstimator(MAX_REQS, K, dev)
        logits = torch.randn(R, VOCAB, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.arange(R, device=dev, dtype=torch.int32)
        conf = torch.ones(MAX_REQS, K, device=dev)
        temp = torch.ones(MAX_REQS, device=dev)
        step0 = torch.zeros((), dtype=torch.int64, device=dev)
        sampled = torch.randint(1, K + 2, (R,), device=dev, generator=g)
        rejected = (K + 1 - sampled).clamp(min=0)

        def predict():
            est.predict(logits, idx, step0, conf, temp)

        def observe():
            est.step(idx, sampled, rejected)

        record, layout = manager_pieces(R, dev, tempfile.mkdtemp(prefix="av_metrics"))

        assert torch.equal(cumsum_into(counts, buf.clone()), sums(counts, buf.clone()))
        row = {
            "R": R,
            "waits": {
                "cumsum_into_buffer": count_waits(lambda: cumsum_into(counts, buf)),
                "device_prefix_sums": count_waits(lambda: sums(counts, buf)),
                "estimator_predict": count_waits(predict),
                "estimator_step": count_waits(observe),
                "prior_confidences": count_waits(est.prior_confidences),
                "manager_record": count_waits(record),
                "manager_layout": count_waits(layout),
            },
            "cumsum_into_buffer": timed(lambda: cumsum_into(counts, buf), args.reps),
            "device_prefix_sums": timed(lambda: sums(counts, buf), args.reps),
            "estimator_predict": timed(predict, args.reps),
            "estimator_predict_torch": timed(unfused(predict), args.reps),
            "estimator_step": timed(observe, args.reps),
            "estimator_step_torch": timed(unfused(observe), args.reps),
            "prior_confidences": timed(est.prior_confidences, args.reps),
            "manager_record": timed(record, args.reps),
            "manager_layout": timed(layout, args.reps),
        }
        rows.append(row)
        print(json.dumps(row))
    result = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "K": K,
        "vocab": VOCAB,
        "reps": args.reps,
        "command": "python benchmarks/mrv2_host_costs.py",
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
