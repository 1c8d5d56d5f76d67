"""The fused estimator kernels equal the torch operations they replace.

Run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors, in a
subprocess so the setting reaches the kernels' definitions).
Confidences: logits with a max that rounds q_max to 1, a tied max, a row
with one finite entry, a padded row, a greedy request, one position for all
rows and one per row, vocabularies of several blocks with a tie for the
max across blocks and a max in the last block.
Observation: NaN and out-of-range features, a padding row, admitted counts
above K and accepted counts above admitted or negative, more requests than
the kernel's block, four steps across a refit; and the same from counts as
rejection sampling reports them (tokens sampled, drafts rejected).
tests/gpu/test_gpu_fused.py runs the same comparison on the device.
"""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from interpreted import run_interpreted  # noqa: E402

CHECK = r'''
import json, os, sys, torch
DEV = os.environ.get("CHECK_DEVICE", "cpu")
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator
from vllm_av.core import fused as fc

def case(N, V, per_row, seed):
    g = torch.Generator().manual_seed(seed)
    R, K = 8, 4
    logits = torch.randn(N, V, generator=g) * 3
    logits[0, 5] = 60.0            # q_max rounds to 1 in float32
    if N > 2:
        logits[2, :] = -float("inf"); logits[2, 7] = 1.0   # one finite entry
    if N > 3:
        logits[3, 10] = logits[3, 11] = 50.0               # a tie for the max
    if N > 5:
        logits[4, 100] = logits[4, V - 2] = 40.0           # a tie across blocks
        logits[5, 3], logits[5, V - 1] = 44.0, 45.0        # the max comes last
    logits = logits.to(torch.bfloat16)
    idx = torch.tensor([i % R for i in range(N)], dtype=torch.int32)
    if N > 1:
        idx[1] = -1                                        # padding
    temp = torch.rand(R, generator=g) + 0.3
    temp[0] = 0.0                                          # greedy
    # One position per row as parallel drafters lay it out: row i is request
    # i // K's draft i % K (no two rows write one slot).
    step = torch.arange(N) % K if per_row else torch.tensor(2)
    logits, idx, temp, step = (t.to(DEV) for t in (logits, idx, temp, step))
    out = {}
    for name, fused in (("fused", True), ("torch", False)):
        est = AcceptanceEstimator(R, K, DEV, refit_interval=8)
        est._coef.copy_(torch.tensor([0.7, 0.1, -0.2, 0.3, 0.05]))
        conf = torch.full((R, K), -1.0, device=DEV)
        if not fused:
            fc_saved = fc.fused_confidences
            import vllm_av.vllm.mrv2.estimator as e
            e.fused_confidences = lambda *a, **k: False
            est.predict(logits, idx, step, conf, temp)
            e.fused_confidences = fc_saved
        else:
            est.predict(logits, idx, step, conf, temp)
        out[name] = (est.features.clone(), conf.clone())
    df = (out["fused"][0] - out["torch"][0]).abs().max().item()
    dc = (out["fused"][1] - out["torch"][1]).abs().max().item()
    return {"N": N, "V": V, "per_row": per_row, "feature_diff": df, "confidence_diff": dc}

rows = [case(5, 1000, False, 0), case(6, 20000, False, 1), case(8, 9000, True, 2), case(1, 300, False, 3),
        case(3, 30000, False, 4)]
print(json.dumps(rows))

# ---- observe: the fused kernel against the core's torch operations
from vllm_av.core.estimator import OnlineAcceptanceEstimator
import vllm_av.core.estimator as ce

def observe_case(n, seed, sampled=False):
    g = torch.Generator().manual_seed(seed)
    R, K = 12, 5
    table = torch.randn(R + 1, K, generator=g) * 4
    table[0, 1] = float("nan"); table[1, 2] = 80.0          # cleaned: 0, clipped
    rows = torch.randint(0, R, (n,), generator=g, dtype=torch.int32)
    rows[0] = -1                                              # padding
    # Counts: admitted (some > K) and accepted (some > admitted, some < 0);
    # or, `sampled`, tokens sampled (0: nothing verified) and drafts
    # rejected (some < 0).
    adm = torch.randint(0, K + 3, (n,), generator=g, dtype=torch.int32)
    acc = torch.randint(-1, K + 2, (n,), generator=g, dtype=torch.int32)
    table, rows, adm, acc = (t.to(DEV) for t in (table, rows, adm, acc))
    res = {}
    for name in ("fused", "torch"):
        est = OnlineAcceptanceEstimator(K, refit_interval=3, intercept=[0.1, -0.3, 0.2, 0.0, 0.4],
                                        device=DEV)
        totals = torch.zeros(2, dtype=torch.float64, device=DEV)
        saved = ce.fused_observe
        if name == "torch":
            ce.fused_observe = lambda *a, **k: False
        observe = est.observe_sampled_rows if sampled else est.observe_rows
        for _ in range(4):   # crosses a refit (interval 3)
            observe(table, rows, adm, acc, totals=totals)
        ce.fused_observe = saved
        res[name] = (est._window.clone(), est._theta.clone(), totals.clone(), est.num_refits)
    return {"observe_n": n, "sampled": sampled,
            "window_diff": (res["fused"][0] - res["torch"][0]).abs().max().item(),
            "theta_diff": (res["fused"][1] - res["torch"][1]).abs().max().item(),
            "totals_diff": (res["fused"][2] - res["torch"][2]).abs().max().item(),
            "refits": [res["fused"][3], res["torch"][3]],
            "window_abs": res["torch"][0].abs().max().item()}

print(json.dumps([observe_case(7, 0), observe_case(300, 1), observe_case(7, 2, sampled=True),
                  observe_case(300, 3, sampled=True)]))
# Kernels that fell back to the torch operations (the comparison above
# would then compare the torch operations with themselves).
print(json.dumps({"failures": fc.kernel_failures()}))
'''


@pytest.fixture(scope="module")
def compared():
    lines = run_interpreted(CHECK)
    failures = json.loads(lines[-1])["failures"]
    assert failures == {}, failures
    return json.loads(lines[-3]), json.loads(lines[-2])


def test_fused_confidences_write_what_the_torch_operations_write(compared):
    rows = compared[0]
    assert len(rows) == 5
    for row in rows:
        # float32 logsumexp against the kernel's two-pass sum: a few ulps.
        assert row["feature_diff"] < 1e-5, row
        assert row["confidence_diff"] < 1e-6, row


def test_fused_observe_adds_the_window_statistics_of_the_torch_operations(compared):
    rows = compared[1]
    assert len(rows) == 4 and [r["sampled"] for r in rows] == [False, False, True, True]
    for row in rows:
        # float64 sums in another order: relative 1e-12 of the largest entry.
        assert row["window_diff"] <= 1e-12 * max(1.0, row["window_abs"]), row
        assert row["theta_diff"] < 1e-6 and row["totals_diff"] == 0.0, row
        assert row["refits"] == [1, 1], row


def test_a_kernel_that_fails_to_launch_falls_back_to_the_torch_operations(monkeypatch):
    """Outside the interpreter a build or launch error is logged once and
    the torch operations serve from then on."""
    from vllm_av.core import fused

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                raise RuntimeError("no such PTX version")
            return launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused, "_FAILED", {})
    assert fused._launch("confidence", Broken(), (1,)) is False
    assert "no such PTX version" in fused.kernel_failures()["confidence"]
    # Not tried again: the next call returns at once.
    assert fused._launch("confidence", object(), (1,)) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "_FAILED", {})
    with pytest.raises(RuntimeError):
        fused._launch("observe", Broken(), (1,))
