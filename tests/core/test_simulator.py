"""The trace-driven server simulator (vllm_av.sim): tapes, costs, policies, ceilings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_av.core.cost_model import CostModel
from vllm_av.sim import (
    POLICY_ORDER,
    StepCost,
    TraceSet,
    h200_design,
    large_deployment,
    load_traces,
    make_policy,
    simulate,
)
from vllm_av.sim.traces import ACCEPTED, BONUS, REJECTED, PromptTape, tape_from_steps

K = 7
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"


@pytest.fixture(scope="module")
def synthetic():
    return TraceSet.synthetic(num_prompts=6, num_steps=20, K=K, seed=1)


def _run(traces, name, cost, C, steps=64, warmup=8, seed=0):
    step_cost = StepCost(cost, K)
    return simulate(traces, make_policy(name, K, step_cost), step_cost, C,
                    max_steps=steps, warmup_steps=warmup, seed=seed)


def test_tape_marks_accepted_correction_and_bonus():
    f = np.arange(2 * K, dtype=np.float32).reshape(2, K)
    q = np.full((2, K), 0.5, dtype=np.float32)
    # Step 0: 2 of 7 accepted, then a correction. Step 1: all 7 accepted, bonus.
    tape = tape_from_steps("p", [K, K], [2, K], [3, K + 1], f, q)
    assert tape.labels.tolist() == [ACCEPTED] * 2 + [REJECTED] + [ACCEPTED] * K + [BONUS]
    assert tape.features[:3].tolist() == [0.0, 1.0, 2.0]  # the rejected draft's own feature
    assert tape.features[-1] == f[1, K - 1] and tape.bonus_accept[-1] == 0.5


def test_run_counts_accepted_drafts_until_the_next_rejection():
    labels = np.array([1, 1, 0, 1, BONUS, 1, 0], dtype=np.int8)
    feats = np.zeros(7, dtype=np.float32)
    for coin, expected in ((1.0, [2, 1, 0, 3, 2, 1, 0]), (0.0, [2, 1, 0, 1, 0, 1, 0])):
        bonus = np.where(labels == BONUS, coin, 0.0).astype(np.float32)
        run, _ = PromptTape("p", labels, feats, bonus).instantiate(np.random.default_rng(0), 3)
        assert run[:7].tolist() == expected
        assert run[7:].tolist() == [0, 0, 0]


def test_verifying_every_draft_replays_the_trace_step_for_step(synthetic):
    one = TraceSet("one", K, synthetic.tapes[:1])
    tape = one.tapes[0]
    steps = int((tape.labels != ACCEPTED).sum())  # one correction or bonus per trace step
    r = _run(one, "fixed_k7", h200_design(K), 1, steps=steps, warmup=0)
    assert r.finished == 1 and r.tokens == tape.length


@pytest.mark.parametrize("C", [1, 8, 32])
def test_oracle_is_never_beaten(synthetic, C):
    for cost in (h200_design(K), large_deployment(K)):
        results = {p: _run(synthetic, p, cost, C).throughput for p in POLICY_ORDER}
        best_other = max(v for p, v in results.items() if p != "oracle")
        assert results["oracle"] >= best_other, results


def test_flat_verify_cost_makes_av_verify_every_draft(synthetic):
    flat = CostModel.from_samples({1: [5.0], 4096: [5.0]}, {1: [1.0], 4096: [1.0]})
    for policy in ("ours", "reference_av"):
        r = _run(synthetic, policy, flat, 8)
        assert r.verified_per_step == pytest.approx(K), policy


def test_prohibitive_extra_token_cost_makes_av_verify_nothing(synthetic):
    C = 8
    # C tokens (one per request) cost 1 ms; a single draft more costs 1e6.
    steep = CostModel.from_samples({C: [1.0], C + 1: [1e6]}, {1: [1.0]})
    for policy in ("ours", "reference_av", "oracle"):
        r = _run(synthetic, policy, steep, C)
        assert r.verified_per_step == 0.0, policy
        assert r.tokens_per_step == pytest.approx(1.0)


def test_simulation_is_deterministic_given_a_seed(synthetic):
    a = _run(synthetic, "ours", h200_design(K), 8, seed=3).to_dict()
    b = _run(synthetic, "ours", h200_design(K), 8, seed=3).to_dict()
    assert a == b


def test_simulator_never_imports_vllm():
    code = ("import sys, vllm_av.sim; "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not TRACES.exists(), reason="real traces not present")
def test_oracle_is_a_ceiling_on_the_real_traces():
    ts = load_traces(TRACES, ["mtbench"])[0]
    for C in (1, 32):
        results = {p: _run(ts, p, h200_design(K), C, steps=48).throughput
                   for p in ("fixed_k3", "fixed_k7", "ours", "oracle")}
        assert results["oracle"] >= max(results.values()), results


# --- benchmarks/validate_simulator.py helpers and batch mode -----------------

def _validate_module():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import validate_simulator

    return validate_simulator


def _breakdown(arm_ms):
    """Fake step_breakdown JSONs: arm -> {C: (target, drafting, sample_tokens, schedule)}."""
    out = {}
    for arm, runs in arm_ms.items():
        rows = []
        for c, (t, d, s, sch) in runs.items():
            ph = {"target_step": t, "sample_tokens": s, "schedule": sch}
            if d is not None:
                ph["drafting"] = d
            rows.append({"concurrency": c, "phases": {k: {"mean_ms": v} for k, v in ph.items()}})
        out[arm] = {"runs": rows}
    return out


def test_isotonic_keeps_monotone_points_and_pools_violations():
    v = _validate_module()
    xs, fit = v.isotonic([1, 4, 8, 64], [1.0, 2.0, 3.0, 5.0])
    assert xs.tolist() == [1, 4, 8, 64] and fit.tolist() == [1.0, 2.0, 3.0, 5.0]
    xs, fit = v.isotonic([1, 4, 8, 8, 64], [1.0, 4.0, 3.0, 2.0, 5.0])
    assert xs.tolist() == [1, 4, 8, 64]
    assert np.all(np.diff(fit) >= 0) and fit.tolist() == pytest.approx([1.0, 3.0, 3.0, 5.0])


def test_measured_step_cost_reproduces_its_points():
    v = _validate_module()
    bd = _breakdown({
        "nospec": {1: (3.0, None, 1.0, 0.2), 64: (3.5, None, 1.1, 0.8)},
        "k3": {1: (4.0, 30.0, 32.0, 0.2), 64: (5.0, 33.0, 35.5, 1.0)},
        "k7": {1: (4.5, 70.0, 72.0, 0.2), 64: (6.0, 77.0, 80.0, 1.0)},
    })
    cost = v.measured_step_cost(bd)
    # verify points at 1, 64 (nospec), 4, 256 (k3), 8, 512 (k7) tokens; the
    # dip at 64 (3.5 after 4.5 at 8) is pooled with 8 tokens: 4.0 at both.
    for n, ms in ((1, 3.0), (4, 4.0), (8, 4.0), (64, 4.0), (256, 5.0), (512, 6.0)):
        assert cost.verify_ms(n) == pytest.approx(ms), n
    sizes = np.arange(1, 600)
    assert np.all(np.diff(cost.verify_ms(sizes)) >= 0)
    for C, d3, d7 in ((1, 30.0, 70.0), (64, 33.0, 77.0)):
        assert cost.draft_ms(np.full(C, 3)) == pytest.approx(d3)
        assert cost.draft_ms(np.full(C, 7)) == pytest.approx(d7)
        assert cost.draft_ms(np.zeros(C, dtype=np.int64)) == 0.0
    assert cost.draft_ms(np.full(64, 5)) == pytest.approx((33.0 + 77.0) / 2)
    assert cost.overhead_ms(np.zeros(1, dtype=np.int64)) == pytest.approx(1.2)
    assert cost.overhead_ms(np.full(64, 7)) == pytest.approx((1.0 + 2.5 + 1.0 + 3.0) / 2)


def test_batch_mode_runs_each_request_once_to_its_end(synthetic):
    step_cost = StepCost(h200_design(K), K)
    C = 4
    r = simulate(synthetic, make_policy("fixed_k3", K, step_cost), step_cost, C,
                 max_steps=10_000, warmup_steps=0, refill=False)
    assert r.finished == C
    assert r.tokens == sum(t.length for t in synthetic.tapes[:C])
    assert r.steps < 10_000
