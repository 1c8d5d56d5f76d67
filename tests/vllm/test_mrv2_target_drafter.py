"""Adaptive drafting depth for EAGLE / MTP on Model Runner V2
(vllm_av/vllm/mrv2/target_drafter.py): the routing, the propose wrapper
over vLLM's depth-honouring speculator, the decode graphs captured per
depth, the pricing of depth 0 as the first forward, and vLLM 0.32's code
the patches rely on (CPU; the whole path runs on the CPU in
tests/vllm/test_mrv2_on_cpu.py with a tiny EAGLE head, on the H200 in
tests/gpu/test_gpu_target_drafter.py)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from mrv2_fakes import mrv2_req_states  # noqa: E402
from vllm_av.vllm.config import AVOptions  # noqa: E402
from vllm_av.vllm.mrv1.scheduled_depth import register_local_verifier  # noqa: E402
from vllm_av.vllm.mrv2.depth import drafter_skipped, set_profile_depth  # noqa: E402
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator  # noqa: E402
from vllm_av.vllm.mrv2.manager import AVManager  # noqa: E402
from vllm_av.vllm.mrv2.target_drafter import (MRV2TargetDrafterDepthPatch,  # noqa: E402
                                              MRV2TargetDrafterGraphsPatch, depths_to_capture,
                                              uses_target_drafter)

K = 4
R_MAX = 8


# ------------------------------------------------------------ vLLM premises
def test_vllm_target_drafter_stops_at_the_depth_it_is_given():
    """vLLM 0.32's EAGLE / MTP propose runs its first forward at every depth,
    fills the drafts with -1 at depth 0, returns after it at depth 1, and
    runs the decode loop for the given depth."""
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import (
        TargetDependentARSpeculator)

    for cls in (EagleSpeculator, MTPSpeculator):
        assert issubclass(cls, TargetDependentARSpeculator)
        assert "propose" not in vars(cls)  # the base class's propose serves both
    src = inspect.getsource(TargetDependentARSpeculator.propose)
    assert "if num_speculative_tokens <= 1:" in src
    assert "self.draft_tokens[:num_reqs].fill_(-1)" in src
    assert "specialize_spec_tokens(" in src
    assert "range(1, num_speculative_steps)" in inspect.getsource(
        TargetDependentARSpeculator._multi_step_decode)


def test_vllm_decode_graph_lookup_asks_for_a_descriptor_per_depth():
    """The runtime lookup our capture feeds: a FULL descriptor not captured
    as is becomes vLLM's per-depth descriptor, used if captured."""
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
        SpeculatorBatchDescriptor, SpeculatorCudaGraphManager)

    src = inspect.getsource(SpeculatorCudaGraphManager.specialize_spec_tokens)
    assert "SpeculatorBatchDescriptor(" in src and "num_speculative_tokens=" in src
    assert "num_speculative_tokens" in {f for f in SpeculatorBatchDescriptor.__dataclass_fields__}
    cap = inspect.getsource(SpeculatorCudaGraphManager.capture)
    assert "self._capture_descs" in cap and 'forward_kwargs["num_speculative_steps"]' in cap


# ------------------------------------------------------------ routing
def _spec(method, mtp_layers=1, k=K):
    spec = SimpleNamespace(method=method, num_speculative_tokens=k)
    spec.use_multi_module_mtp = lambda: method == "mtp" and min(mtp_layers, k) > 1
    return spec


def test_routing_takes_eagle_and_single_module_mtp_only():
    from vllm_av.vllm.config_patch import mrv2_schedules_depth

    on, off = AVOptions(adaptive_depth=True), AVOptions(adaptive_depth=False)
    for method in ("eagle", "eagle3", "mtp"):
        assert uses_target_drafter(_spec(method)) and mrv2_schedules_depth(_spec(method), on)
        assert not mrv2_schedules_depth(_spec(method), off)
    # Several MTP layers in use: V2's multi-module speculator, which has its own propose.
    assert not uses_target_drafter(_spec("mtp", mtp_layers=3))
    assert not mrv2_schedules_depth(_spec("mtp", mtp_layers=3), on)
    for method in ("dflash", "dspark", "draft_model", "ngram", None):
        assert not uses_target_drafter(_spec(method))
    assert not uses_target_drafter(None)


# ------------------------------------------------------------ the drafter
class _TargetDrafter:
    """An EAGLE speculator as the patch sees it; the original propose runs
    one forward per depth (at least one), writes a confidence per forward
    and -1 drafts at depth 0, as vLLM's does."""

    propose = MRV2TargetDrafterDepthPatch.propose

    def __init__(self, scheduled_depth=True):
        self.num_speculative_steps = K
        self.vllm_config = SimpleNamespace(additional_config={
            "vllm_av": AVOptions(scheduled_depth=scheduled_depth).to_dict()})
        self.draft_tokens = torch.zeros(R_MAX, K, dtype=torch.int64)
        self.draft_token_confidence_probs = torch.full((R_MAX, K), 0.5)
        self.acceptance_estimator = AcceptanceEstimator(R_MAX, K, torch.device("cpu"))
        self.forwards: list[int] = []

    def _orig_propose(self, input_batch, *args, num_speculative_tokens=None, **kwargs):
        n = input_batch.num_reqs
        depth = K if num_speculative_tokens is None else num_speculative_tokens
        for step in range(max(depth, 1)):
            self.forwards.append(step)
            self.draft_tokens[:n, step] = 100 + step
            self.draft_token_confidence_probs[:n, step] = 0.9
        if depth == 0:
            self.draft_tokens[:n].fill_(-1)
        return self.draft_tokens[:n]


def _propose(d, depth, **kwargs):
    return d.propose(SimpleNamespace(num_reqs=3), num_speculative_tokens=depth, **kwargs)


def test_depth_zero_runs_the_first_forward_and_records_nothing():
    d = _TargetDrafter()
    _propose(d, 0)
    assert d.forwards == [0] and drafter_skipped()
    _propose(d, K)
    assert not drafter_skipped()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_slots_past_the_depth_get_the_prior(depth):
    d = _TargetDrafter()
    _propose(d, depth)
    assert d.forwards == list(range(depth)) and not drafter_skipped()
    conf = d.draft_token_confidence_probs[:3]
    assert (conf[:, :depth] == 0.9).all()
    prior = d.acceptance_estimator.prior_confidences()
    torch.testing.assert_close(conf[:, depth:], prior[depth:].expand(3, K - depth))
    assert (d.draft_token_confidence_probs[3:] == 0.5).all()  # other rows untouched


def test_without_the_patch_stale_confidences_stay_past_the_depth():
    """Negative control: vLLM's propose alone leaves an older step's
    confidences in the slots it did not draft."""
    d = _TargetDrafter()
    d.draft_token_confidence_probs[:3] = 0.1
    d._orig_propose(SimpleNamespace(num_reqs=3), num_speculative_tokens=2)
    assert (d.draft_token_confidence_probs[:3, 2:] == 0.1).all()


def test_profile_dummy_runs_draft_at_the_profile_depth_only_while_it_is_set():
    set_profile_depth(1)
    try:
        d = _TargetDrafter()
        _propose(d, None, dummy_run=True)
        assert d.forwards == [0]
        off = _TargetDrafter(scheduled_depth=False)
        _propose(off, None, dummy_run=True)
        assert off.forwards == list(range(K))
    finally:
        set_profile_depth(None)
    d = _TargetDrafter()
    _propose(d, None, dummy_run=True)
    assert d.forwards == list(range(K))


def test_depth_off_and_full_depth_run_unchanged():
    for depth, on in ((K, True), (None, True), (0, False), (2, False)):
        d = _TargetDrafter(scheduled_depth=on)
        d.draft_token_confidence_probs[:3] = 0.1
        _propose(d, depth)
        expected = list(range(max(K if depth is None else depth, 1)))
        assert d.forwards == expected and not drafter_skipped(), (depth, on)
        past = K if depth is None else max(depth, 1)
        assert (d.draft_token_confidence_probs[:3, past:] == 0.1).all()


# ------------------------------------------------------------ decode graphs
class _GraphManager:
    """vLLM's SpeculatorCudaGraphManager as the capture patch sees it."""

    capture = MRV2TargetDrafterGraphsPatch.capture

    def __init__(self, decode_query_len=1, scheduled_depth=True, k=K):
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        self.decode_query_len = decode_query_len
        self.vllm_config = SimpleNamespace(num_speculative_tokens=k, additional_config={
            "vllm_av": AVOptions(scheduled_depth=scheduled_depth).to_dict()})
        fields = BatchExecutionDescriptor.__dataclass_fields__
        base = {f: None for f in fields}
        base.update(cg_mode=CUDAGraphMode.FULL, num_tokens=8, num_reqs=8)
        if "num_ubatches" in fields:
            base["num_ubatches"] = 1
        self._capture_descs = {CUDAGraphMode.FULL: [BatchExecutionDescriptor(**base)]}
        self.captured = None

    def _orig_capture(self, forward_fn, *args, specialize_spec_tokens=False, **kwargs):
        self.captured = (list(self._capture_descs.values())[0], specialize_spec_tokens)


def _generate_fused_drafts():
    pass


def _generate_draft():
    pass


def test_the_fused_decode_loop_is_captured_once_per_depth():
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import (
        SpeculatorBatchDescriptor)

    assert depths_to_capture(4) == [4, 3, 2] and depths_to_capture(1) == []
    g = _GraphManager()
    g.capture(_generate_fused_drafts, "state", progress_bar_desc="x")
    descs, specialize = g.captured
    assert not specialize
    assert all(isinstance(x, SpeculatorBatchDescriptor) for x in descs)
    assert [x.num_speculative_tokens for x in descs] == [4, 3, 2]
    assert {x.num_tokens for x in descs} == {8}
    # A second capture (the descriptors already per depth) captures the same.
    g.capture(_generate_fused_drafts, "state")
    assert g.captured[0] == descs


@pytest.mark.parametrize("case", ["unfused", "prefill", "depth_off", "vllm_specializes"])
def test_other_captures_run_unchanged(case):
    g = _GraphManager(decode_query_len=K + 1 if case == "prefill" else 1,
                      scheduled_depth=case != "depth_off")
    fn = _generate_draft if case == "unfused" else _generate_fused_drafts
    g.capture(fn, "state", specialize_spec_tokens=case == "vllm_specializes")
    descs, specialize = g.captured
    assert specialize == (case == "vllm_specializes")
    assert len(descs) == 1 and not hasattr(descs[0], "num_speculative_tokens")


# ------------------------------------------------------------ pricing
@pytest.fixture
def verifier_slot():
    yield
    register_local_verifier(None)


def _manager(tmp_path, first_forward_at_zero):
    ids = ["a", "b"]
    m = AVManager(mrv2_req_states(ids, K, R_MAX), torch.zeros(R_MAX + 1, dtype=torch.int32),
                  num_bonus_tokens=1, max_total_logits=10_000,
                  options=AVOptions(metrics_dir=str(tmp_path), scheduled_depth=True),
                  first_forward_at_zero=first_forward_at_zero)
    m.set_cost_curves([(1, [8.0]), (8, [8.0])], [(1, [1.0]), (64, [1.0])])
    return m


def test_depth_zero_is_priced_as_the_first_forward(tmp_path, verifier_slot):
    eagle = _manager(tmp_path / "eagle", first_forward_at_zero=True)
    assert eagle.profile_depth_one
    assert not eagle.cost.free_zero_depth and eagle.cost.zero_depth_forward
    assert float(eagle.cost.draft_cost_at_depth(2, 0, K)) == pytest.approx(8.0 / K)
    # Negative control: a draft model whose depth 0 skips the drafter is free there.
    skipped = _manager(tmp_path / "draft", first_forward_at_zero=False)
    assert skipped.cost.free_zero_depth
    assert float(skipped.cost.draft_cost_at_depth(2, 0, K)) == 0.0
