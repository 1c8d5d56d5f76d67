"""Model Runner V2 adapter: targets, interface parity with vLLM 0.32's AV
manager and estimator, and the manager and estimator on CPU tensors."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from mrv2_fakes import K, R_MAX, first_trimmed_step, make_manager, mrv2_req_states  # noqa: E402
from mrv2_fakes import batch as _batch, manager_step as _step  # noqa: E402
from mrv2_fakes import steep_cost as _cost  # noqa: E402
from vllm_av.core.budget import size_budget  # noqa: E402
from vllm_av.core.cost_model import CostModel  # noqa: E402
from vllm_av.core.features import draft_features  # noqa: E402
from vllm_av.core.selector import compiled_select_admitted, select_admitted  # noqa: E402
from vllm_av.vllm.config import AVOptions  # noqa: E402
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator  # noqa: E402
from vllm_av.vllm.mrv2.manager import AVManager  # noqa: E402
from vllm_av.vllm.mrv2.patches import (  # noqa: E402
    MRV2_PATCHES,
    MRV2EstimatorPatch,
    MRV2FactoryPatch,
    mrv2_available,
)


# ------------------------------------------------------------- interface
def test_patch_targets_exist_in_vllm_032():
    import vllm.v1.worker.gpu.model_runner as runner
    import vllm.v1.worker.gpu.spec_decode.speculator as speculator

    assert callable(runner.maybe_create_adaptive_verification_manager)
    assert inspect.isclass(speculator.OnlineAcceptanceEstimator)
    for patch in MRV2_PATCHES:
        assert patch.platforms == ("cuda",)
        target = patch.resolve_target()
        assert all(hasattr(target, a) for a in patch.attributes)


def _params(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _check_same_call(ours, theirs):
    """Every parameter of vLLM's method, in order and kind; extras of ours
    only after them, with defaults."""
    mine, want = _params(ours), _params(theirs)
    assert mine[: len(want)] == want, (mine, want)
    extra = list(inspect.signature(ours).parameters.values())[len(want):]
    assert all(p.default is not inspect.Parameter.empty for p in extra)


def test_manager_has_vllm_managers_methods_and_signatures():
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import (
        AdaptiveVerificationManager,
    )

    public = [n for n, v in vars(AdaptiveVerificationManager).items()
              if callable(v) and (not n.startswith("_") or n == "__init__")]
    assert {"get_num_tokens", "compact_batch", "reallocate_drafts",
            "record_confidences", "add_request"} <= set(public)
    for name in public:
        _check_same_call(getattr(AVManager, name), getattr(AdaptiveVerificationManager, name))


def test_estimator_has_vllm_estimators_signatures():
    from vllm.v1.worker.gpu.spec_decode.acceptance_estimator import (
        OnlineAcceptanceEstimator,
    )

    for name in ("__init__", "predict", "step"):
        _check_same_call(getattr(AcceptanceEstimator, name),
                         getattr(OnlineAcceptanceEstimator, name))


def test_factory_signature_matches_and_replacement_is_keyword_only():
    import vllm.v1.worker.gpu.spec_decode.adaptive_verification as av

    theirs = inspect.signature(av.maybe_create_adaptive_verification_manager)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in theirs.parameters.values())
    assert MRV2FactoryPatch.attributes == ("maybe_create_adaptive_verification_manager",)
    assert MRV2EstimatorPatch.attributes == ("OnlineAcceptanceEstimator",)


def test_mrv2_available_only_on_cuda():
    assert mrv2_available("cuda")
    assert not mrv2_available("cpu")


# ------------------------------------------------------------- fakes
def _req_states(ids):
    return mrv2_req_states(ids, K, R_MAX)


def _manager(ids, estimator=None, req_states=None):
    return make_manager(ids, req_states=req_states)


def test_manager_step_admits_top_budget_prefixes_from_current_scores():
    ids = ["a", "b", "c"]
    m = _manager(ids)
    first = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.99, 0.2, 0.9, 0.9]])
    m.record_confidences(first, _batch([0, 1, 2]))
    second = torch.tensor([[0.95, 0.9, 0.8, 0.7], [0.3, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.1]])
    m.record_confidences(second, _batch([0, 1, 2]))
    budget, num_tokens, admitted, cu, qsl = _step(m, ids, [K, K, K])

    # The budget came from the FIRST step's scores (stale), via our sizer.
    stale = torch.cumprod(first, 1).numpy().ravel()
    assert budget == size_budget(stale, 3, 3, 3, m.cost, max_budget=3 * K)
    assert 0 < budget < 3 * K
    # Selection: our selector on the CURRENT survival.
    want = select_admitted(torch.cumprod(second, 1), torch.full((3,), K), budget).numpy()
    np.testing.assert_array_equal(admitted, want)
    assert admitted.sum() == budget and num_tokens == 3 + budget
    np.testing.assert_array_equal(qsl[: 4], np.concatenate([[0], np.cumsum(admitted + 1)]))
    assert (qsl[4:] == num_tokens).all()


@pytest.mark.parametrize("warm, recompiles", [("admission", False), ("fresh_tensors", True)])
def test_warmed_admission_leaves_no_compile_to_the_first_trimmed_step(warm, recompiles):
    """The compiled selector (here with Dynamo's eager backend) guards on
    its inputs' dispatch keys. The manager's buffers are made outside
    inference mode, a served step runs in it: the warm-up must call the
    selector on the same buffers, or the first step that trims recompiles
    (as on the GPU, where that cost 0.14-0.21 s once). Negative control:
    the warm-up on fresh tensors leaves that recompile. The same on a GPU
    with inductor: tests/gpu/test_gpu_admission_warmup.py."""
    torch._dynamo.reset()
    try:
        ids = ["a", "b", "c"]
        m = _manager(ids)  # built outside inference mode, as in the engine
        m._select = compiled_select_admitted(backend="eager")
        budget, admitted, want, warm_graphs, step_graphs = first_trimmed_step(m, ids, warm)
        assert warm_graphs >= 1
        assert 0 < budget < 3 * K  # trimmed: the device admission ran
        np.testing.assert_array_equal(admitted, want)
        assert (step_graphs > 0) == recompiles
    finally:
        torch._dynamo.reset()


def test_admission_warm_up_leaves_vllm_buffers_and_state_untouched():
    ids = ["a", "b"]
    m = _manager(ids)
    m.query_start_loc.fill_(7)
    with torch.inference_mode():
        m._warm_admission()
    assert (m.query_start_loc == 7).all()
    for buf in (m._layout, m._drafted, m._non_draft):
        assert not buf.any()
    assert (m._conf_rows == 1).all()


def test_budget_never_reads_the_drafts_being_verified():
    ids = ["a", "b"]
    budgets = []
    for current in (0.01, 0.99):
        m = _manager(ids)
        m.record_confidences(torch.full((2, K), 0.8), _batch([0, 1]))
        m.record_confidences(torch.full((2, K), current), _batch([0, 1]))
        budgets.append(_step(m, ids, [K, K])[0])
    assert budgets[0] == budgets[1]


def test_new_request_is_scored_with_the_estimator_prior():
    ids = ["a", "b"]
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=1)
    m = _manager(ids)
    m.record_confidences(torch.full((2, K), 0.9), _batch([0, 1]))
    m.record_confidences(torch.full((2, K), 0.9), _batch([0, 1]))
    # "b" leaves, "c" takes its slot and has drafted once: its row in the
    # stale copy is still b's (0.9), so it must be scored with the prior.
    m.req_states.req_id_to_index = {"a": 0, "c": 1}
    m.add_request(1)
    m.record_confidences(torch.full((2, K), 0.9), _batch([0, 1]))
    m.get_num_tokens({"a": 1 + K, "c": 1 + K}, {"a": [0] * K, "c": [0] * K})
    stale = m._slots[m._stale_idx]
    prior = est.prior_confidences().numpy()
    np.testing.assert_allclose(stale.np[R_MAX], prior, rtol=1e-6)
    assert m._first_record[1] > stale.step and m._first_record[0] <= stale.step
    m._batch = None
    del est


def test_each_manager_claims_the_estimator_built_for_its_engine():
    """The runner builds the drafter's estimator, then the manager, with no
    handle between them. An engine whose drafter built none (a trained
    head) must not pick up the estimator of an earlier engine still alive
    in the process; an estimator of another shape is not this engine's."""
    earlier = AcceptanceEstimator(R_MAX, K, torch.device("cpu"))
    assert _manager(["a"])._estimator() is earlier  # claimed by its engine
    assert _manager(["a"])._estimator() is None  # the next engine built none
    mine = AcceptanceEstimator(R_MAX, K, torch.device("cpu"))  # control: one built
    assert _manager(["a"])._estimator() is mine
    AcceptanceEstimator(R_MAX, K + 1, torch.device("cpu"))
    assert _manager(["a"])._estimator() is None
    del earlier, mine


def test_both_managers_of_one_engine_score_with_its_estimator():
    """With CUDA graphs vLLM builds the manager twice on one runner: once
    while profiling the graphs' memory, then to serve. The serving manager
    must get the engine's estimator too, not read as scored by a head
    (which leaves the estimator's counters out of /metrics and budgets new
    requests at the head's mean). A manager of another engine built after
    them still gets none."""
    mine = AcceptanceEstimator(R_MAX, K, torch.device("cpu"))
    rs = _req_states(["a"])
    assert _manager(["a"], req_states=rs)._estimator() is mine  # the profiling pass
    assert _manager(["a"], req_states=rs)._estimator() is mine  # the serving manager
    assert _manager(["a"])._estimator() is None  # another engine, none built
    del mine


def test_with_a_trained_head_a_new_request_is_scored_at_the_recorded_mean():
    """A drafter with a trained confidence head (DSpark): vLLM builds no
    acceptance estimator, and the prior row a new request is budgeted with
    is the mean of the head's confidences the last record carried, per
    position. Negative control: before any record the row is 1.0 (every
    draft a sure accept), what the budget would read without this. An
    estimator of an earlier engine is alive meanwhile, claimed by it."""
    ids = ["a", "b"]
    earlier = AcceptanceEstimator(R_MAX, K, torch.device("cpu"))
    _manager(ids)
    m = _manager(ids)
    assert m._estimator() is None
    assert (m._slots[m._stale_idx].np[R_MAX] == 1.0).all()
    head = torch.tensor([[0.9, 0.6, 0.3, 0.2], [0.5, 0.2, 0.1, 0.0]])[:, :K]
    m.record_confidences(head, _batch([0, 1]))
    m.record_confidences(head, _batch([0, 1]))  # the first record has landed
    stale = m._slots[m._stale_idx]
    np.testing.assert_allclose(stale.np[R_MAX], head.mean(0).numpy(), rtol=1e-6)
    rows = m.stale_survival(["a", "new"])
    np.testing.assert_allclose(rows[1], np.cumprod(head.mean(0).numpy()), rtol=1e-5)
    # No estimator's counters to land: /metrics says the head scored.
    assert m.stats.confidence_source == "head" and m.stats.coefficients == []
    assert m._snapshot_view().stats.confidence_source == "head"
    del earlier


def test_zero_and_full_budgets():
    ids = ["a", "b"]
    m = _manager(ids)
    m.cost = CostModel.from_samples({1: [1.0], 64: [1000.0]}, {1: [0.0]})  # verifying hurts
    m.record_confidences(torch.full((2, K), 0.1), _batch([0, 1]))
    m.record_confidences(torch.full((2, K), 0.1), _batch([0, 1]))
    budget, num_tokens, admitted, cu, qsl = _step(m, ids, [K, K])
    assert budget == 0 and num_tokens == 2 and admitted.tolist() == [0, 0]
    assert qsl[:3].tolist() == [0, 1, 2] and (qsl[3:] == 2).all()
    assert m._admitted[:2].tolist() == [0, 0]
    m.cost = CostModel.from_samples({1: [1.0], 64: [1.0]}, {1: [0.0]})  # verifying is free
    budget, num_tokens, admitted, cu, qsl = _step(m, ids, [K, 2])
    assert budget == K + 2 and admitted.tolist() == [K, 2]
    # The layout sent from the host: offsets of each request's tokens, the
    # rows past the batch at the total; the device's admitted counts.
    assert qsl[:3].tolist() == [0, K + 1, K + 4] and (qsl[3:] == K + 4).all()
    assert num_tokens == K + 4 and m._admitted[:2].tolist() == [K, 2]


def test_cost_curves_from_step_timing_samples():
    from vllm.v1.worker.gpu.async_utils import StepTimingSample

    m = _manager(["a"])
    m.cost = None
    batches = list(m.batches_to_profile([1, 2, 4, 8]))
    sizes = sorted({b["num_tokens"] for b in batches})
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 64 and max(sizes) <= 64
    assert len(batches) == len(sizes) * m.options.profile_repeats
    assert all(b["context_len"] == m.options.profile_context_len for b in batches)
    samples = [StepTimingSample(forward_ms=1.0 + n / 100, drafter_ms=0.2, num_target_tokens=n,
                                num_reqs=n, full_cudagraph=n <= 8) for n in sizes]
    m.set_initial_cost_curves(samples)
    assert m.cost.verify_cost(3) == pytest.approx(1.04)  # staircase: padded to 4
    assert m.cost.draft_cost(8) == pytest.approx(0.2)


def test_a_draft_models_drafting_is_profiled_at_depth_one_too(tmp_path):
    """With adaptive depth, the dummy runs vLLM times are ours to yield:
    every size at depth K, then (the profile depth set while vLLM runs
    them) the sizes of at most max_num_reqs at depth 1. Their drafting
    times price depth 1, and depths between by interpolation; depth K
    keeps its own. Negative control: timings that do not match the runs
    fall back to d/K of the K-deep table, with a warning."""
    from vllm.v1.worker.gpu.async_utils import StepTimingSample

    import vllm_av.vllm.mrv2.depth as depth_mod

    def profiled(mismatch=False):
        rs = _req_states(["a"])
        m = AVManager(rs, torch.zeros(R_MAX + 1, dtype=torch.int32), num_bonus_tokens=1,
                      max_total_logits=10_000, draft_model=True,
                      options=AVOptions(metrics_dir="", scheduled_depth=True))
        runs = []
        for batch in m.batches_to_profile([1, 2, 4, 8]):
            runs.append((batch["num_tokens"], depth_mod._PROFILE_DEPTH["depth"]))
        assert depth_mod._PROFILE_DEPTH["depth"] is None  # cleared when done
        # Drafting: 1 ms per request count unit at depth K, 0.3 at depth 1.
        samples = [StepTimingSample(forward_ms=1.0, num_target_tokens=n, num_reqs=min(n, R_MAX),
                                    drafter_ms=(0.3 if d == 1 else 1.0) * min(n, R_MAX),
                                    full_cudagraph=True) for n, d in runs]
        m.set_initial_cost_curves(samples[:-1] if mismatch else samples)
        return m, runs

    m, runs = profiled()
    deep = [n for n, d in runs if d is None]
    shallow = [n for n, d in runs if d == 1]
    assert runs == [(n, None) for n in deep] + [(n, 1) for n in shallow]  # K first, then depth 1
    assert sorted(set(shallow)) == [n for n in sorted(set(deep)) if n <= R_MAX]
    c = m.cost
    assert float(c.draft_cost_at_depth(8, 1, K)) == pytest.approx(2.4)
    assert float(c.draft_cost_at_depth(8, K, K)) == pytest.approx(8.0)
    assert 2.4 < float(c.draft_cost_at_depth(8, 2, K)) < 8.0
    m, _ = profiled(mismatch=True)
    assert float(m.cost.draft_cost_at_depth(8, 1, K)) == pytest.approx(8.0 / K)


# ------------------------------------------------------------- estimator
def test_estimator_predict_writes_features_and_confidences_skipping_padding():
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    idx = torch.tensor([5, 2, -1])
    temp = torch.ones(R_MAX)
    temp[2] = 0.5
    conf = torch.full((R_MAX, K), -1.0)
    est.predict(logits, idx, torch.tensor(1), conf, temp)
    f = draft_features(logits[:2], torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(est.features[[5, 2], 1], f)
    p = torch.sigmoid(est.coefficients[0] * f + est.coefficients[2])
    torch.testing.assert_close(conf[:2, 1], p)
    assert (conf[2:] == -1).all() and (conf[:, [0, 2, 3]] == -1).all()

    # Block drafting (dflash): K rows per request, a step per row.
    logits = torch.randn(2 * K, 50, generator=g)
    idx = torch.tensor([3] * K + [-1] * K)
    steps = torch.arange(K).repeat(2)
    conf = torch.full((R_MAX, K), -1.0)
    est.predict(logits, idx, steps, conf, temp)
    torch.testing.assert_close(est.features[3], draft_features(logits[:K], 1.0))
    assert (conf[0] >= 0).all() and (conf[1:] == -1).all()


def test_estimator_step_feeds_our_core_estimator():
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)
    est.features[:2] = torch.tensor([[3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    before = est.coefficients.clone()
    idx = torch.tensor([0, 1])
    for _ in range(2):
        est.step(idx, num_sampled=torch.tensor([3, 1]), num_rejected=torch.tensor([1, 2]))
    assert est.core.num_steps == 2 and est.core.num_refits == 1
    assert not torch.equal(est.coefficients, before)
    torch.testing.assert_close(est.coefficients, est.core.coefficients)
    # accepted 2 + 0, verified 3 + 2, per step.
    assert est.totals.tolist() == [4.0, 10.0]
    # The intercept of position 0 rose (a's first draft accepted), b's
    # rejection pulled position 0 down: both labelled.
    assert est.core.statistics()["count"].sum() == 0  # cleared by the refit


def test_factory_returns_ours_only_with_our_options(monkeypatch):
    import vllm_av.vllm.mrv2.patches as patches

    calls = []

    class FakeModule:
        @staticmethod
        def _orig_maybe_create_adaptive_verification_manager(**kwargs):
            calls.append(kwargs)
            return object() if kwargs["enable_adaptive_verification"] else None

    monkeypatch.setattr(patches.importlib, "import_module", lambda name: FakeModule)
    rs = _req_states(["a"])
    kwargs = dict(enable_adaptive_verification=True, attn_groups=[], req_states=rs,
                  query_start_loc=torch.zeros(R_MAX + 1, dtype=torch.int32),
                  num_bonus_tokens=1, max_total_logits=1000)
    ours_cfg = SimpleNamespace(additional_config={"vllm_av": AVOptions().to_dict()})
    theirs_cfg = SimpleNamespace(additional_config={})
    m = patches.maybe_create_adaptive_verification_manager(**kwargs, vllm_config=ours_cfg)
    assert isinstance(m, AVManager) and not m.first_forward_at_zero
    m = patches.maybe_create_adaptive_verification_manager(**kwargs, vllm_config=theirs_cfg)
    assert not isinstance(m, AVManager) and m is not None
    # An EAGLE drafter: its first forward runs at depth 0 (target_drafter.py).
    eagle_cfg = SimpleNamespace(additional_config={"vllm_av": AVOptions().to_dict()},
                                speculative_config=SimpleNamespace(method="eagle"))
    m = patches.maybe_create_adaptive_verification_manager(**kwargs, vllm_config=eagle_cfg)
    assert isinstance(m, AVManager) and m.first_forward_at_zero and not m.parallel_drafter
    kwargs["enable_adaptive_verification"] = False
    assert patches.maybe_create_adaptive_verification_manager(**kwargs, vllm_config=ours_cfg) is None
    assert len(calls) == 4


# ------------------------------------------------------------- routing
def test_ngram_is_routed_to_model_runner_v2_with_our_seam():
    """vLLM 0.32's V2 runner builds an AV manager only for speculators that
    carry `enable_adaptive_verification`: its draft-model family sets it,
    its ngram speculator does not (checked on vLLM's own classes, so this
    fails when vLLM adds the seam and MRV2NgramAVPatch can go). Our patch
    adds it; the config is routed with our options and adaptive depth
    (depth 0 skips the scan: MRV2NgramAVPatch.propose)."""
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, DraftModelSpeculator

    from vllm_av.vllm.config_patch import route_mrv2
    from vllm_av.vllm.mrv2.ngram import MRV2NgramAVPatch

    assert "enable_adaptive_verification" in inspect.getsource(DraftModelSpeculator.__init__)
    assert not issubclass(NgramGPUSpeculator, DraftModelSpeculator)
    assert issubclass(NgramGPUSpeculator, BaseSpeculator)
    assert "enable_adaptive_verification" not in inspect.getsource(
        getattr(NgramGPUSpeculator, "_orig___init__", NgramGPUSpeculator.__init__))
    assert "enable_adaptive_verification" not in inspect.getsource(BaseSpeculator)
    assert MRV2NgramAVPatch in MRV2_PATCHES

    def config(method):
        spec = SimpleNamespace(method=method, num_speculative_tokens=7,
                               use_ngram=lambda: method in ("ngram", "ngram_gpu"))
        return SimpleNamespace(speculative_config=spec, additional_config={})

    for method in ("ngram", "ngram_gpu", "draft_model"):
        cfg = config(method)
        route_mrv2(cfg)
        assert cfg.additional_config["vllm_av"]["scheduled_depth"] is True


def test_prior_confidences_are_kept_between_refits_and_follow_each_refit():
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)
    first = est.prior_confidences()
    idx = torch.arange(2, dtype=torch.int32)
    est.step(idx, torch.tensor([K + 1, 1], dtype=torch.int32), torch.tensor([0, K], dtype=torch.int32))
    assert est.prior_confidences() is first  # one step: no refit, the same tensor
    est.step(idx, torch.tensor([K + 1, 1], dtype=torch.int32), torch.tensor([0, K], dtype=torch.int32))
    assert est.core.num_refits == 1
    after = est.prior_confidences()
    assert after is not first
    # The rates of the refitted estimator's prior survival.
    surv = est.core.prior_survival(K).float()
    prev = torch.cat([torch.ones(1), surv[:-1]])
    torch.testing.assert_close(after, torch.where(prev > 0, surv / prev, torch.zeros_like(surv)))
    # Half the drafts of the two steps were all accepted, half rejected at
    # the first slot: the first rate is 1/2, not the prior's.
    assert abs(float(after[0]) - float(first[0])) > 0.05 and abs(float(after[0]) - 0.5) < 0.05
    del est


def test_serving_starts_from_the_prior_not_from_warm_up_drafts():
    # vLLM 0.32's V2 warm-up runs decode steps with dummy drafts through the
    # speculator's estimator before the cost tables are built; nearly all
    # are accepted. Served steps must start from the prior, with zero counts.
    from vllm.v1.worker.gpu.async_utils import StepTimingSample

    fresh = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)
    fresh_coef, fresh_prior = fresh.coefficients.clone(), fresh.prior_confidences().clone()
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)  # the live one
    m = _manager(["a", "b"])
    m.cost = None
    idx = torch.arange(R_MAX)
    est.features[:R_MAX] = 3.0
    for _ in range(6):  # warm-up: every dummy draft accepted
        est.step(idx, torch.full((R_MAX,), K + 1), torch.zeros(R_MAX, dtype=torch.int64))
    assert est.totals.tolist() == [6.0 * R_MAX * K] * 2
    assert not torch.allclose(est.coefficients, fresh_coef)
    samples = [StepTimingSample(forward_ms=1.0, drafter_ms=0.2, num_target_tokens=n,
                                num_reqs=n, full_cudagraph=True) for n in (1, 8, 64)]
    m.set_initial_cost_curves(samples)
    assert est.totals.tolist() == [0.0, 0.0]
    torch.testing.assert_close(est.coefficients, fresh_coef)
    torch.testing.assert_close(est.prior_confidences(), fresh_prior)
    assert est.core.num_steps == 0 and not est.features.any()
    # The manager's next record carries the prior's coefficients and counts.
    m.record_confidences(torch.full((2, K), 0.5), _batch([0, 1]))
    out = m._slots[1 - m._stale_idx]
    assert out.stats_dev[:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(out.stats_dev[2:].float(), fresh_coef)
    torch.testing.assert_close(out.dev[R_MAX], fresh_prior)
    del est, fresh
