"""Adaptive drafting depth on Model Runner V2: the depth choice over the
manager's stale confidences, the draft-model speculator stopped at that
depth, the routing, and vLLM 0.32's code that both rely on (CPU tensors;
the served path runs on the H200, tests/gpu/test_gpu_av.py)."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from mrv2_fakes import mrv2_req_states  # noqa: E402
from vllm_av.vllm.config import AVOptions  # noqa: E402
from vllm_av.vllm.mrv1.scheduled_depth import local_verifier, register_local_verifier  # noqa: E402
from vllm_av.vllm.mrv2.depth import MRV2DraftDepthPatch  # noqa: E402
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator  # noqa: E402
from vllm_av.vllm.mrv2.manager import AVManager  # noqa: E402

K = 4
R_MAX = 8


# ------------------------------------------------------------ vLLM premises
def test_vllm_runner_passes_the_depth_and_masks_drafts_past_it():
    """The patch leaves drafts past the depth to the runner, which masks
    them with -1 and schedules only the first `depth` of them."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner.sample_tokens)
    assert "num_speculative_tokens=num_spec_tokens" in src
    assert "draft_tokens[:, num_spec_tokens:] = -1" in src
    assert "draft_tokens[input_batch.idx_mapping, :num_spec_tokens]" in src


def test_vllm_standalone_drafter_loops_over_its_step_count():
    """The depth patch stops the drafter by setting its step count for the
    call: its decode loop and its one-step return must read that count."""
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    assert "range(1, self.num_speculative_steps)" in inspect.getsource(
        StandaloneARSpeculator._multi_step_decode)
    src = inspect.getsource(StandaloneARSpeculator.propose)
    assert "if self.num_speculative_steps == 1" in src
    assert "num_speculative_tokens" in str(inspect.signature(StandaloneARSpeculator.propose))


# ------------------------------------------------------------ the drafter
class _Drafter:
    """A standalone drafter's state as the patch sees it; the original
    propose drafts one column per step it is told to run."""

    propose = MRV2DraftDepthPatch.propose

    def __init__(self, scheduled_depth=True, fail=False, zero_depth_skips_drafter=True):
        self.num_speculative_steps = K
        self.vllm_config = SimpleNamespace(additional_config={
            "vllm_av": AVOptions(scheduled_depth=scheduled_depth,
                                 zero_depth_skips_drafter=zero_depth_skips_drafter).to_dict()})
        self.draft_tokens = torch.zeros(R_MAX, K, dtype=torch.int64)
        self.draft_token_confidence_probs = torch.full((R_MAX, K), 0.5)
        self.acceptance_estimator = AcceptanceEstimator(R_MAX, K, torch.device("cpu"))
        self.forwards: list[int] = []
        self.fail = fail

    def _orig_propose(self, input_batch, *args, **kwargs):
        n, steps = input_batch.num_reqs, self.num_speculative_steps
        for step in range(steps):
            self.forwards.append(step)
            self.draft_tokens[:n, step] = 100 + step
            self.draft_token_confidence_probs[:n, step] = 0.9
        if self.fail:
            raise RuntimeError("drafter failed")
        return self.draft_tokens[:n, :1] if steps == 1 else self.draft_tokens[:n]


def _propose(d, depth, **kwargs):
    return d.propose(SimpleNamespace(num_reqs=3), num_speculative_tokens=depth, **kwargs)


def test_depth_zero_skips_the_drafter_and_says_so():
    from vllm_av.vllm.mrv2.depth import drafter_skipped

    d = _Drafter()
    out = _propose(d, 0)
    assert d.forwards == [] and out.shape == (3, K) and drafter_skipped()
    assert (d.draft_token_confidence_probs == 0.5).all()  # nothing recorded, nothing written
    _propose(d, 2)
    assert not drafter_skipped()


def test_depth_zero_keeping_the_drafter_kv_runs_its_first_forward_alone():
    """Option zero_depth_skips_drafter off: depth 0 runs the drafter's first
    forward (its KV cache stays whole), restores K, and still has nothing
    to record (the runner masks the draft)."""
    from vllm_av.vllm.mrv2.depth import drafter_skipped

    d = _Drafter(zero_depth_skips_drafter=False)
    _propose(d, 0)
    assert d.forwards == [0] and d.num_speculative_steps == K and drafter_skipped()
    d.fail = True
    with pytest.raises(RuntimeError, match="drafter failed"):
        _propose(d, 0)
    assert d.num_speculative_steps == K


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_d_runs_d_forwards_then_restores_k(depth):
    d = _Drafter()
    out = _propose(d, depth)
    assert d.forwards == list(range(depth)) and d.num_speculative_steps == K
    assert out.shape == (3, K)  # all K columns: the runner masks those past the depth
    assert (out[:, :depth] == 100 + torch.arange(depth)).all()
    conf = d.draft_token_confidence_probs[:3]
    assert (conf[:, :depth] == 0.9).all()
    prior = d.acceptance_estimator.prior_confidences()
    torch.testing.assert_close(conf[:, depth:], prior[depth:].expand(3, K - depth))


def test_profile_dummy_runs_draft_at_the_profile_depth_only_while_it_is_set():
    from vllm_av.vllm.mrv2.depth import set_profile_depth

    set_profile_depth(1)
    try:
        d = _Drafter()
        _propose(d, None, dummy_run=True)
        assert d.forwards == [0] and d.num_speculative_steps == K
        off = _Drafter(scheduled_depth=False)  # adaptive depth off: vLLM's K
        _propose(off, None, dummy_run=True)
        assert off.forwards == list(range(K))
    finally:
        set_profile_depth(None)
    d = _Drafter()
    _propose(d, None, dummy_run=True)
    assert d.forwards == list(range(K))


def test_full_depth_dummy_runs_and_depth_off_run_unchanged():
    for depth, kwargs, on in ((K, {}, True), (None, {}, True), (1, {"dummy_run": True}, True),
                              (0, {}, False), (2, {}, False)):
        d = _Drafter(scheduled_depth=on)
        _propose(d, depth, **kwargs)
        assert d.forwards == list(range(K)), (depth, kwargs, on)


def test_failed_draft_restores_the_step_count():
    d = _Drafter(fail=True)
    with pytest.raises(RuntimeError, match="drafter failed"):
        _propose(d, 2)
    assert d.num_speculative_steps == K


# ------------------------------------------------------------ the choice
def _manager(ids, draft_ms, tmp_path, scheduled_depth=True, zero_depth_skips_drafter=True,
             parallel_drafter=False, drafter_catch_up=False, req_states=None,
             test_fixed_depth=-1):
    m = AVManager(req_states or mrv2_req_states(ids, K, R_MAX),
                  torch.zeros(R_MAX + 1, dtype=torch.int32),
                  num_bonus_tokens=1, max_total_logits=10_000,
                  options=AVOptions(metrics_dir=str(tmp_path), metrics_interval=1,
                                    scheduled_depth=scheduled_depth,
                                    zero_depth_skips_drafter=zero_depth_skips_drafter,
                                    drafter_catch_up=drafter_catch_up,
                                    test_fixed_depth=test_fixed_depth),
                  parallel_drafter=parallel_drafter)
    for i in range(len(ids)):
        m.add_request(i)
    # Verification flat up to 64 tokens: extra tokens are free to verify,
    # so drafting pays or not by its own cost alone.
    m.set_cost_curves([(1, [draft_ms]), (8, [draft_ms])], [(1, [1.0]), (64, [1.0])])
    return m


@pytest.fixture
def verifier_slot():
    before = local_verifier()
    yield
    register_local_verifier(before)


def _choices(m, ids, steps=6):
    return [m.choose_depth(ids, len(ids), len(ids)) for _ in range(steps)]


def test_cheap_drafts_of_confident_requests_go_deep_dear_ones_stop(tmp_path, verifier_slot):
    ids = ["a", "b"]
    cheap = _manager(ids, draft_ms=0.01, tmp_path=tmp_path)
    assert local_verifier() is cheap and cheap.cost.free_zero_depth
    cheap.record_confidences(torch.full((2, K), 0.95), SimpleNamespace(
        num_reqs=2, idx_mapping=torch.tensor([0, 1]), idx_mapping_np=np.array([0, 1])))
    cheap.record_confidences(torch.full((2, K), 0.95), SimpleNamespace(
        num_reqs=2, idx_mapping=torch.tensor([0, 1]), idx_mapping_np=np.array([0, 1])))
    assert _choices(cheap, ids) == [K] * 6
    dear = _manager(ids, draft_ms=50.0, tmp_path=tmp_path)
    assert set(_choices(dear, ids)) == {0}
    assert dear.stats.zero_depth_steps == dear.stats.depth_steps == 6


def test_a_run_of_depth_zero_steps_reuses_its_choice_without_an_estimator(
        tmp_path, verifier_slot, monkeypatch):
    """With no estimator in the engine's drafter and nothing landed, the
    prior is all ones: handed over as one array, so the depth-0 memo holds
    and a run of depth-0 steps searches the depths once more (a fresh array
    every step made every step search: 51-177 us per lookup on the CPU at
    1-256 requests instead of 2.7-3.3, `benchmarks/mrv2_depth_overhead.py
    --without-estimator`)."""
    ids = ["a", "b"]
    m = _manager(ids, draft_ms=50.0, tmp_path=tmp_path)
    assert m._estimator() is None
    assert m.prior_survival_host() is m.prior_survival_host()
    searches = []
    search = m.depth._search_depth
    monkeypatch.setattr(m.depth, "_search_depth",
                        lambda *a, **k: searches.append(1) or search(*a, **k))
    assert set(_choices(m, ids, steps=20)) == {0}
    # The first step reads the rows (no depth chosen before it), the
    # second fills the memo, the other 18 reuse it.
    assert len(searches) == 2


def test_depth_reads_stale_rows_new_requests_get_the_prior(tmp_path, verifier_slot):
    """Rows with low stale confidence stop drafting where confident rows
    would draft; a request the runner has not seen is scored with the
    prior. The current drafts are never read: only landed host copies."""
    ids = ["a", "b"]
    batch = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([0, 1]),
                            idx_mapping_np=np.array([0, 1]))
    m = _manager(ids, draft_ms=0.4, tmp_path=tmp_path)
    m.record_confidences(torch.full((2, K), 0.02), batch)
    m.record_confidences(torch.full((2, K), 0.99), batch)  # not landed yet
    rows = m.stale_survival(ids + ["new"])
    np.testing.assert_allclose(rows[0], np.cumprod(np.full(K, 0.02)), rtol=1e-5)
    np.testing.assert_allclose(rows[2], m.prior_survival_host(), rtol=1e-6)
    assert m.choose_depth(ids, 2, 2) == 0
    m.record_confidences(torch.full((2, K), 0.99), batch)  # now 0.99 has landed
    m.depth._last_depth = K  # rows are read (not the prior) after a drafting step
    assert m.choose_depth(ids, 2, 2) > 0


def test_depth_steps_reach_metrics_without_any_budgeted_step(tmp_path, verifier_slot):
    from vllm_av.vllm.metrics import read_snapshot

    ids = ["a"]
    m = _manager(ids, draft_ms=50.0, tmp_path=tmp_path)
    _choices(m, ids, steps=3)
    assert m.stats.num_steps == 0  # nothing was budgeted
    snap = read_snapshot(str(tmp_path))
    assert snap and snap["depth_steps"] == 3 and snap["zero_depth_steps"] == 3
    assert snap["depth_counts"] == [3] + [0] * K  # per depth 0..K


def test_with_catch_up_the_manager_reads_the_token_history_and_reports_the_positions(
        tmp_path, verifier_slot):
    from vllm_av.vllm.metrics import read_snapshot
    from vllm_av.vllm.mrv2 import catch_up

    states = mrv2_req_states(["a"], K, R_MAX)
    m = _manager(["a"], draft_ms=50.0, tmp_path=tmp_path, drafter_catch_up=True,
                 req_states=states)
    assert catch_up._STATE["history"] is states.all_token_ids
    ledger = catch_up.CatchUpLedger(R_MAX, K)
    catch_up.bind_ledger(ledger)
    ledger.skipped(["a"], [0], [6])
    ledger.windows(["a"], [0], [100], room=100)
    _choices(m, ["a"], steps=1)
    assert read_snapshot(str(tmp_path))["catch_up_tokens"] == 6
    # Without the option the snapshot has no such field.
    _choices(_manager(["a"], draft_ms=50.0, tmp_path=tmp_path / "off"), ["a"], steps=1)
    assert "catch_up_tokens" not in read_snapshot(str(tmp_path / "off"))
    catch_up.bind_ledger(None)


def test_fixed_depth_control_overrides_the_choice_within_its_bounds(tmp_path, verifier_slot):
    """VLLM_AV_TEST_FIXED_DEPTH (a measurement control): the policy would
    draft K here (cheap drafts) and 0 with dear ones; the control holds
    the depth given, raised to a step's minimum, capped at K, and the
    steps are counted in /metrics as any others."""
    ids = ["a"]
    cheap = _manager(ids, draft_ms=0.01, tmp_path=tmp_path / "d0", test_fixed_depth=0)
    assert _choices(cheap, ids, steps=3) == [0] * 3
    assert cheap.stats.zero_depth_steps == cheap.stats.depth_steps == 3
    dear = _manager(ids, draft_ms=50.0, tmp_path=tmp_path / "d1", test_fixed_depth=1)
    assert _choices(dear, ids, steps=2) == [1, 1]
    assert dear.choose_depth(ids, 1, 1, min_depth=K) == K  # a seeded request's minimum
    deep = _manager(ids, draft_ms=50.0, tmp_path=tmp_path / "d9", test_fixed_depth=K + 5)
    assert _choices(deep, ids, steps=1) == [K]
    # Negative control: without it the dear drafts stop.
    assert set(_choices(_manager(ids, draft_ms=50.0, tmp_path=tmp_path / "off"), ids)) == {0}


def test_without_scheduled_depth_the_manager_drafts_k(tmp_path, verifier_slot):
    register_local_verifier(None)
    m = _manager(["a"], draft_ms=50.0, tmp_path=tmp_path, scheduled_depth=False)
    assert m.depth is None and local_verifier() is None
    assert m.choose_depth(["a"], 1, 1) == K


# ------------------------------------------------------------ routing
def test_v2_routes_adaptive_depth_for_draft_models_and_ngram_not_block_drafters():
    from vllm_av.vllm.config_patch import mrv2_schedules_depth

    on, off = AVOptions(adaptive_depth=True), AVOptions(adaptive_depth=False)
    spec = SimpleNamespace
    assert mrv2_schedules_depth(spec(method="draft_model"), on)
    assert not mrv2_schedules_depth(spec(method="draft_model"), off)
    assert mrv2_schedules_depth(spec(method="ngram"), on)
    assert not mrv2_schedules_depth(spec(method="ngram"), off)
    for method in ("dflash", "dspark"):  # one parallel pass: no depth to stop at
        assert not mrv2_schedules_depth(spec(method=method), on)


def test_a_parallel_drafter_pays_its_whole_step_at_any_depth_and_nothing_at_zero(
        tmp_path, verifier_slot):
    # ngram proposes all K in one scan: depth 1 costs what depth K costs, and
    # only depth 0 (no scan) saves it, whatever zero_depth_skips_drafter says.
    ngram = _manager(["a", "b"], draft_ms=2.0, tmp_path=tmp_path, parallel_drafter=True,
                     zero_depth_skips_drafter=False)
    model = _manager(["a", "b"], draft_ms=2.0, tmp_path=tmp_path, zero_depth_skips_drafter=False)
    cost = [float(ngram.cost.draft_cost_at_depth(2, d, K)) for d in range(K + 1)]
    assert cost[0] == 0.0 and cost[1:] == pytest.approx([2.0] * K)
    # An autoregressive drafter: d of K forwards, depth 0 its first forward.
    model_cost = [float(model.cost.draft_cost_at_depth(2, d, K)) for d in range(K + 1)]
    assert model_cost[1] == pytest.approx(2.0 / K) and model_cost[0] == pytest.approx(2.0 / K)


# ------------------------------------------------------------ depth-0 steps
def test_depth_zero_step_records_nothing_and_does_not_wait(tmp_path, verifier_slot, monkeypatch):
    """After a skipped drafter the manager returns before its host wait and
    leaves its copies alone; a drafting step records as before."""
    import vllm_av.vllm.mrv2.depth as depth

    ids = ["a", "b"]
    batch = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([0, 1]),
                            idx_mapping_np=np.array([0, 1]))
    m = _manager(ids, draft_ms=0.4, tmp_path=tmp_path)
    monkeypatch.setitem(depth._LAST_PROPOSE, "skipped", True)
    m.record_confidences(torch.full((2, K), 0.3), batch)
    assert m._record_step == 0 and m._slots[0].step == m._slots[1].step == -1
    monkeypatch.setitem(depth._LAST_PROPOSE, "skipped", False)
    m.record_confidences(torch.full((2, K), 0.3), batch)
    assert m._record_step == 1


def test_estimator_learns_only_from_steps_whose_drafts_were_budgeted(tmp_path, verifier_slot):
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=1)
    m = _manager(["a"], draft_ms=0.4, tmp_path=tmp_path)
    assert est._only_verified
    idx = torch.tensor([0])

    def step(accepted):
        est.step(idx, torch.tensor([accepted + 1]), torch.tensor([K - accepted]))
        return est.totals.tolist()

    assert step(2) == [0.0, 0.0]  # no budgeted drafts this step: skipped
    m.get_num_tokens({"a": 1 + K}, {"a": [0] * K})
    assert step(2) == [2.0, float(K)]
    assert step(2) == [2.0, float(K)]  # the flag is spent
    m._batch = None
    del est


@pytest.mark.parametrize("skips", [True, False])
def test_depth_zero_is_priced_as_what_it_runs(tmp_path, verifier_slot, skips):
    """Depth 0 skipping the drafter costs no drafting; depth 0 keeping its
    KV cache costs the one forward it runs (1/K of the profiled K-deep
    step, as depth 1)."""
    m = _manager(["a", "b"], 14.0, tmp_path, zero_depth_skips_drafter=skips)
    assert m.cost.free_zero_depth is skips
    zero = float(m.cost.draft_cost_at_depth(2, 0, K))
    assert zero == (0.0 if skips else pytest.approx(float(m.cost.draft_cost_at_depth(2, 1, K))))
    if not skips:
        assert zero == pytest.approx(14.0 / K)


def test_step_periods_reach_the_costs_only_from_steady_scheduled_steps(
        tmp_path, verifier_slot, monkeypatch):
    """Option step_period_calibration: the time between two depth choices
    is the earlier step's period, passed on when both steps decoded the
    same requests without prompt tokens and the period is no idle gap; off,
    nothing is passed on."""
    from vllm_av.vllm.mrv2 import manager as manager_mod

    ids = ["a", "b"]
    m = _manager(ids, 14.0, tmp_path)
    m.options = dataclasses.replace(m.options, step_period_calibration=True)
    seen = []
    monkeypatch.setattr(m.depth, "observe_step_period",
                        lambda d, n, ms: seen.append((d, n, round(ms, 3))))
    clock = iter([0.0, 0.002, 0.004, 0.006, 0.008, 10.0, 10.002])
    monkeypatch.setattr(manager_mod.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(m.depth, "choose_depth", lambda *a, **kw: 0)
    m.choose_depth(ids, 2, 2)                       # t=0: nothing before it
    m.choose_depth(ids, 2, 2)                       # t=2 ms: step 1's period
    m.choose_depth(ids + ["c"], 3, 3)               # a new request: batch changed
    m.choose_depth(ids + ["c"], 3, 3, may_explore=False)  # prompt tokens: not steady
    m.choose_depth(ids + ["c"], 3, 3)               # after an unsteady step: nothing
    m.choose_depth(ids + ["c"], 3, 3)               # t=10 s: an idle gap
    m.choose_depth(ids + ["c"], 3, 3)               # t=10.002: a period again
    assert seen == [(0, 2, 2.0), (0, 3, 2.0)]
    m.options = dataclasses.replace(m.options, step_period_calibration=False)
    clock = iter([20.0, 20.002])
    m.choose_depth(ids, 2, 2)
    m.choose_depth(ids, 2, 2)
    assert len(seen) == 2
