"""Model Runner V2: the target step's attention metadata without the draft's
layers (option skip_draft_layer_metadata, vllm_av/vllm/mrv2/draft_metadata.py).

vLLM's own `DefaultModelState.prepare_attn` and `build_attn_metadata` run
on the CPU here, patched, over stand-in attention groups whose builders
count their builds: a target group, a draft group (layers vLLM marked
`is_draft_layer`), and variants. With the option on only target groups are
built, at capture as at replay; with it off (negative control), for another
method, or with a KV connector, every group is.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_av.vllm.config import ADDITIONAL_CONFIG_KEY, AVOptions  # noqa: E402
from vllm_av.vllm.mrv2.draft_metadata import (  # noqa: E402
    MRV2DraftLayerMetadataPatch,
    target_attention_groups,
)
from vllm_av.vllm.patching import apply_patch, revert_patch  # noqa: E402

TARGET = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
DRAFT = ("draft_model.model.layers.0.self_attn.attn",
         "draft_model.model.layers.1.self_attn.attn")
NUM_REQS, NUM_TOKENS = 3, 6


# ------------------------------------------------------------- interface
def test_patch_target_exists_with_vllm_032s_signature():
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    target = MRV2DraftLayerMetadataPatch.resolve_target()
    assert target is DefaultModelState
    assert MRV2DraftLayerMetadataPatch.platforms == ("cuda",)
    theirs = inspect.signature(DefaultModelState.prepare_attn).parameters.values()
    ours = inspect.signature(MRV2DraftLayerMetadataPatch.prepare_attn).parameters.values()
    assert [(p.name, p.kind, p.default) for p in ours] == \
        [(p.name, p.kind, p.default) for p in theirs]
    # The mark we identify the draft's layers by, and the build we rely on
    # to skip KV cache groups left without attention groups.
    assert AttentionLayerBase.is_draft_layer is False
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

    assert list(inspect.signature(build_attn_metadata).parameters)[0] == "attn_groups"


def test_it_is_registered_for_model_runner_v2():
    from vllm_av.vllm.mrv2.patches import MRV2_PATCHES

    assert MRV2DraftLayerMetadataPatch in MRV2_PATCHES


# ------------------------------------------------------------- stand-ins
class _Builder:
    supports_update_block_table = False

    def __init__(self, log, name):
        self.log, self.name = log, name


class _Group:
    """Stands in for vLLM's AttentionGroup: layers, a spec, one builder
    that logs (group name, "build" or "capture")."""

    def __init__(self, log, name, layers):
        self.layer_names = list(layers)
        self.kv_cache_spec = object()  # not a MambaSpec
        self.builder = _Builder(log, name)

    def get_metadata_builder(self, ubatch_idx=0):
        return self.builder

    def build_metadata(self, common, ubatch_idx=0, **kwargs):
        self.builder.log.append((self.builder.name, "build"))
        return (self.builder.name, common.num_reqs)

    def build_metadata_for_cudagraph_capture(self, common, ubatch_idx=0):
        self.builder.log.append((self.builder.name, "capture"))
        return (self.builder.name, common.num_reqs)


def _vllm_config(skip=True, method="draft_model", kv_transfer_config=None, unknown=()):
    """skip None: our options' defaults."""
    layers = {n: SimpleNamespace(is_draft_layer=False) for n in TARGET}
    layers.update({n: SimpleNamespace(is_draft_layer=True) for n in DRAFT})
    for n in unknown:
        layers.pop(n)
    return SimpleNamespace(
        additional_config={ADDITIONAL_CONFIG_KEY: (
            AVOptions() if skip is None else AVOptions(skip_draft_layer_metadata=skip)).to_dict()},
        speculative_config=SimpleNamespace(method=method),
        kv_transfer_config=kv_transfer_config,
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


def _model_state(vllm_config):
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    state = DefaultModelState.__new__(DefaultModelState)
    state.vllm_config = vllm_config
    state.model_config = SimpleNamespace(max_model_len=64)
    state.supports_mm_inputs = False
    state.encoder_cache = None
    return state


def _input_batch():
    qsl = np.array([0, 2, 4, 6], dtype=np.int32)
    return SimpleNamespace(
        num_reqs=NUM_REQS, num_tokens=NUM_TOKENS,
        num_reqs_after_padding=NUM_REQS, num_tokens_after_padding=NUM_TOKENS,
        query_start_loc_np=qsl, query_start_loc=torch.from_numpy(qsl),
        max_query_len=2, seq_lens_cpu_upper_bound=torch.tensor([5, 6, 7], dtype=torch.int32),
        seq_lens=torch.tensor([5, 6, 7], dtype=torch.int32),
        dcp_local_seq_lens=None, dcp_local_seq_lens_cpu_upper_bound=None,
        positions=torch.arange(NUM_TOKENS), is_prefilling_np=np.zeros(NUM_REQS, dtype=bool),
        req_ids=["a", "b", "c"], prompt_lens=None, idx_mapping_np=np.arange(NUM_REQS),
        fast_prefill=None,
    )


def _prepare(state, groups, for_capture=False):
    """One target build as the runner (or the capture) makes it."""
    from vllm.config.compilation import CUDAGraphMode

    num_kv = len(groups)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[object()] * num_kv)
    block_tables = tuple(torch.zeros(NUM_REQS, 4, dtype=torch.int32) for _ in range(num_kv))
    slot_mappings = torch.zeros(num_kv, NUM_TOKENS, dtype=torch.int64)
    mode = CUDAGraphMode.FULL if for_capture else CUDAGraphMode.NONE
    return state.prepare_attn(_input_batch(), mode, block_tables, slot_mappings,
                              groups, kv_cache_config, for_capture=for_capture)


@pytest.fixture
def patched():
    apply_patch(MRV2DraftLayerMetadataPatch)
    try:
        yield
    finally:
        revert_patch(MRV2DraftLayerMetadataPatch)


def _one_kv_group(log):
    return [[_Group(log, "target", TARGET), _Group(log, "draft", DRAFT)]]


# ------------------------------------------------------------- behaviour
def test_option_on_builds_the_target_groups_only_at_every_step(patched):
    log = []
    state, groups = _model_state(_vllm_config(skip=True)), _one_kv_group(log)
    for _ in range(3):
        metadata = _prepare(state, groups)
        assert set(metadata) == set(TARGET)
    assert log == [("target", "build")] * 3
    assert [g.builder.name for g in groups[0]] == ["target", "draft"]  # left as vLLM holds it


def test_as_served_target_steps_build_the_target_groups_only(patched):
    # On by default on V2 since the twenty-sixth H200 round; V1's own
    # option stays off until its GPU test passes.
    log = []
    state, groups = _model_state(_vllm_config(skip=None)), _one_kv_group(log)
    assert set(_prepare(state, groups)) == set(TARGET)
    assert log == [("target", "build")]
    assert AVOptions().skip_draft_layer_metadata_v1 is False


def test_negative_control_option_off_builds_the_draft_groups_too(patched):
    log = []
    state, groups = _model_state(_vllm_config(skip=False)), _one_kv_group(log)
    for _ in range(3):
        assert set(_prepare(state, groups)) == set(TARGET) | set(DRAFT)
    assert log == [("target", "build"), ("draft", "build")] * 3


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_drafters_that_reuse_the_target_metadata_get_every_group(patched, method):
    log = []
    state, groups = _model_state(_vllm_config(method=method)), _one_kv_group(log)
    assert set(_prepare(state, groups)) == set(TARGET) | set(DRAFT)
    assert ("draft", "build") in log


def test_a_kv_connector_gets_every_group(patched):
    log = []
    state = _model_state(_vllm_config(kv_transfer_config=SimpleNamespace()))
    _prepare(state, _one_kv_group(log))
    assert ("draft", "build") in log


def test_capture_and_replay_build_the_same_groups(patched):
    log = []
    state, groups = _model_state(_vllm_config()), _one_kv_group(log)
    captured = _prepare(state, groups, for_capture=True)
    replayed = _prepare(state, groups)
    assert set(captured) == set(replayed) == set(TARGET)
    assert log == [("target", "capture"), ("target", "build")]


def test_a_group_holding_any_target_layer_is_always_built(patched):
    log = []
    mixed = _Group(log, "mixed", (DRAFT[0], TARGET[0]))
    unknown = _Group(log, "unknown", (DRAFT[1],))  # a layer vLLM does not know
    groups = [[mixed, unknown, _Group(log, "draft", (DRAFT[0],)), _Group(log, "target", (TARGET[1],))]]
    state = _model_state(_vllm_config(unknown=(DRAFT[1],)))
    _prepare(state, groups)
    assert sorted(log) == [("mixed", "build"), ("target", "build"), ("unknown", "build")]


def test_a_kv_cache_group_of_draft_layers_alone_keeps_its_place(patched):
    log = []
    groups = [[_Group(log, "target", TARGET)], [_Group(log, "draft", DRAFT)]]
    state = _model_state(_vllm_config())
    assert set(_prepare(state, groups)) == set(TARGET)
    assert log == [("target", "build")]


def test_a_build_of_draft_groups_alone_is_left_whole(patched):
    """As a speculator's own build would be, if it came through here."""
    log = []
    state = _model_state(_vllm_config())
    assert set(_prepare(state, [[_Group(log, "draft", DRAFT)]])) == set(DRAFT)
    assert log == [("draft", "build")]


def test_groups_refilled_after_the_memory_profile_are_the_ones_built(patched):
    """vLLM captures the graphs once against a throwaway KV cache, clears
    the runner's groups in place and builds new ones; the builders of the
    old groups must never be built again (the V1 version's failure)."""
    log = []
    state = _model_state(_vllm_config())
    groups = [[_Group(log, "old_target", TARGET), _Group(log, "old_draft", DRAFT)]]
    _prepare(state, groups, for_capture=True)
    groups.clear()
    groups += [[_Group(log, "new_target", TARGET), _Group(log, "new_draft", DRAFT)]]
    log.clear()
    _prepare(state, groups, for_capture=True)
    _prepare(state, groups)
    assert log == [("new_target", "capture"), ("new_target", "build")]


def test_unpatched_vllm_builds_every_group():
    """Without the patch vLLM builds both groups: what the option saves."""
    log = []
    state, groups = _model_state(_vllm_config()), _one_kv_group(log)
    _prepare(state, groups)
    assert log == [("target", "build"), ("draft", "build")]


def test_target_attention_groups_drops_only_draft_only_groups():
    log = []
    t, d, m = _Group(log, "t", TARGET), _Group(log, "d", DRAFT), _Group(log, "m", (TARGET[0], DRAFT[0]))
    empty = _Group(log, "e", ())
    assert target_attention_groups([[t, d, m, empty]], set(DRAFT)) == [[t, m, empty]]
    assert target_attention_groups([[t, m]], set(DRAFT)) is None  # nothing to drop
    assert target_attention_groups([[d]], set(DRAFT)) is None  # nothing would be left


@pytest.mark.parametrize("skip, skips", [(True, 3), (False, 0)])
def test_the_distribution_tests_count_of_skipping_builds(patched, skip, skips):
    """tests/vllm/forced_depth.py's counter, which the GPU distribution
    test asserts on: one per build that left the draft's groups out."""
    import vllm_av.vllm.mrv2.draft_metadata as draft_metadata
    from forced_depth import count_draft_metadata_skips

    choose = draft_metadata.groups_to_build
    try:
        count = count_draft_metadata_skips()
        state, groups = _model_state(_vllm_config(skip=skip)), _one_kv_group([])
        for _ in range(3):
            _prepare(state, groups)
        assert count == [skips]
    finally:
        draft_metadata.groups_to_build = choose
