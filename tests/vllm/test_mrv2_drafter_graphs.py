"""The host side of our FULL graphs for Model Runner V2's draft model
(vllm_av/vllm/mrv2/drafter_graphs.py): which graphs are captured, which one
a batch replays, the dummy layout a graph is captured on, and when the
drafter runs eagerly instead. The graphs themselves run on the GPU
(tests/gpu/test_gpu_av.py: outputs and acceptance against the eager
drafter)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_av.vllm.mrv2 import drafter_graphs as dg
from vllm_av.vllm.mrv2.drafter_graphs import (
    DrafterGraphs,
    capturable_kinds,
    GraphShape,
    MRV2DrafterGraphsPatch,
    capture_query_lens,
    decode_shapes,
    drafter_graphs_on,
    pick_shape,
    prefill_shapes,
)

SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512]
K = 7


def test_graphs_follow_our_av_unless_switched():
    from types import SimpleNamespace

    from vllm_av.vllm.config import AVOptions

    ours = SimpleNamespace(additional_config={"vllm_av": AVOptions().to_dict()})
    plain = SimpleNamespace(additional_config={})  # fixed K, or vLLM's own AV
    # Unset: on where our AV serves the engine, vLLM's drafter elsewhere.
    assert drafter_graphs_on(ours, {}) and not drafter_graphs_on(plain, {})
    assert drafter_graphs_on(plain, {"VLLM_AV_DRAFTER_GRAPHS": "1"})
    assert not drafter_graphs_on(ours, {"VLLM_AV_DRAFTER_GRAPHS": "0"})
    with pytest.raises(ValueError, match="VLLM_AV_DRAFTER_GRAPHS"):
        drafter_graphs_on(ours, {"VLLM_AV_DRAFTER_GRAPHS": "yes please"})


def test_shapes_cover_the_capture_sizes_within_the_limits():
    pre = prefill_shapes(SIZES, max_num_reqs=64, max_tokens=256)
    assert [s.num_tokens for s in pre] == [2, 4, 8, 16, 24, 32, 48, 64, 128, 256]
    # Two tokens at least per request of the expanded batch, and no more
    # requests than the engine serves.
    assert [s.num_reqs for s in pre] == [1, 2, 4, 8, 12, 16, 24, 32, 64, 64]
    dec = decode_shapes(SIZES, max_num_reqs=64)
    assert [(s.num_tokens, s.num_reqs) for s in dec] == [
        (1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (24, 24), (32, 32), (48, 48), (64, 64)]


def test_graphs_are_captured_only_where_the_attention_backend_replays_them():
    assert capturable_kinds(3, K) == (True, True)  # any batch (FlashAttention)
    assert capturable_kinds(2, K) == (False, True)  # uniform batches: no mixed prefill
    assert capturable_kinds(1, K) == (False, True)
    assert capturable_kinds(0, K) == (False, False)
    assert capturable_kinds(3, 1) == (True, False)  # K=1 has no decode forward


def test_a_batch_replays_the_smallest_graph_that_holds_it():
    pre = prefill_shapes(SIZES, max_num_reqs=64, max_tokens=512)
    assert pick_shape(pre, 9, 1) == GraphShape("prefill", 16, 8)
    assert pick_shape(pre, 16, 8) == GraphShape("prefill", 16, 8)
    assert pick_shape(pre, 17, 2) == GraphShape("prefill", 24, 12)
    assert pick_shape(pre, 513, 1) is None
    # More requests than a size holds: the next size that holds them.
    shapes = [GraphShape("prefill", 8, 2), GraphShape("prefill", 16, 8)]
    assert pick_shape(shapes, 6, 3) == GraphShape("prefill", 16, 8)
    assert pick_shape(shapes, 6, 9) is None


def test_prompt_chunks_and_oversized_batches_fit_no_graph():
    graphs = DrafterGraphs(kv_cache_config=object(), max_query_len=K + 1,
                           prefill=prefill_shapes(SIZES, 256, 512),
                           decode=decode_shapes(SIZES, 256))
    assert graphs.prefill_shape(10, 2, K + 1) is not None
    assert graphs.prefill_shape(40, 2, K + 2) is None  # a prompt chunk
    assert graphs.prefill_shape(600, 60, 4) is None
    assert graphs.decode_shape(200) == GraphShape("decode", 256, 256)
    assert graphs.decode_shape(257) is None


@pytest.mark.parametrize("seed", range(5))
def test_the_capture_layout_is_as_long_as_any_batch_the_graph_replays(seed):
    """FA3 bakes the longest query of the captured batch into the graph:
    every batch a prefill graph can be picked for (requests of 2..K+2
    expanded tokens) must have no longer query than the captured layout's
    first one, and the layout must fit the graph."""
    rng = np.random.default_rng(seed)
    shapes = prefill_shapes(SIZES, max_num_reqs=256, max_tokens=512)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        lens = rng.integers(2, K + 3, size=n)
        shape = pick_shape(shapes, int(lens.sum()), n)
        if shape is None:
            continue
        captured = capture_query_lens(shape, K + 2)
        assert captured[0] >= lens.max()
        assert captured.sum() <= shape.num_tokens and len(captured) == shape.num_reqs
        assert (captured >= 0).all()


def test_decode_capture_layout_is_one_token_per_request():
    assert capture_query_lens(GraphShape("decode", 8, 8), 1).tolist() == [1] * 8


class _Spec:
    """A stand-in speculator: the patch's methods over originals that
    record which graph (None: eager) was in force when vLLM's code ran."""

    _prefill = MRV2DrafterGraphsPatch._prefill
    _multi_step_decode = MRV2DrafterGraphsPatch._multi_step_decode
    _build_attn_metadata = MRV2DrafterGraphsPatch._build_attn_metadata
    _run_model = MRV2DrafterGraphsPatch._run_model

    def __init__(self, graphs=None, kv=None):
        self.kv_cache_config = kv
        self._vllm_av_graphs = graphs
        self.num_speculative_steps = K
        self.input_buffers = SimpleNamespace(query_start_loc=torch.full((300,), 99))
        self.calls = []

    def _orig__prefill(self, *args):
        self.calls.append(("prefill", self._vllm_av_replay))

    def _orig__multi_step_decode(self, *args):
        self.calls.append(("decode", self._vllm_av_replay))

    def _orig__build_attn_metadata(self, num_reqs, batch_desc, **kwargs):
        return batch_desc

    def _orig__run_model(self, input_ids, *args):
        return "eager forward"


class _Batch:
    def __init__(self, query_lens):
        self.query_start_loc_np = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        self.num_tokens = int(sum(query_lens))


def _graphs(kv):
    return DrafterGraphs(kv_cache_config=kv, max_query_len=K + 1,
                         prefill=prefill_shapes(SIZES, 256, 512), decode=decode_shapes(SIZES, 256))


def test_fitting_batches_run_vllms_code_with_a_graph_in_force():
    kv = object()
    spec = _Spec(_graphs(kv), kv)
    spec._prefill(_Batch([8, 8, 1]), None, None, 3, False, None)
    spec._multi_step_decode(_Batch([8, 8, 1]), None, 3, False, None)
    assert spec.calls == [("prefill", GraphShape("prefill", 24, 12)),
                          ("decode", GraphShape("decode", 4, 4))]
    # The decode graph's padded requests (3 of 4) get empty queries.
    assert spec.input_buffers.query_start_loc[4:5].tolist() == [3]
    assert spec.input_buffers.query_start_loc[5] == 99  # past the graph: untouched
    assert spec._vllm_av_replay is None  # nothing in force afterwards


@pytest.mark.parametrize("case", ["no graphs", "stale kv cache", "prompt chunk", "skip attn",
                                  "data parallel"])
def test_other_batches_run_the_eager_drafter(case):
    kv = object()
    spec = _Spec(None if case == "no graphs" else _graphs(kv),
                 object() if case == "stale kv cache" else kv)
    lens = [40, 1] if case == "prompt chunk" else [4, 4]
    skip = case == "skip attn"
    dp = object() if case == "data parallel" else None
    spec._prefill(_Batch(lens), None, None, 2, skip, dp)
    if case != "prompt chunk":
        spec._multi_step_decode(_Batch(lens), None, 2, skip, dp)
    assert spec.calls == ([("prefill", None)] if case == "prompt chunk"
                          else [("prefill", None), ("decode", None)])
    assert (spec.input_buffers.query_start_loc == 99).all()


def test_with_a_graph_in_force_metadata_takes_its_shape_and_forwards_replay_it(monkeypatch):
    kv = object()
    graphs = _graphs(kv)
    shape = GraphShape("decode", 4, 4)
    graphs.graphs[shape] = SimpleNamespace(replay=lambda: None)
    graphs.outputs[shape] = torch.arange(4)
    spec = _Spec(graphs, kv)
    monkeypatch.setattr(dg, "_full_desc", lambda s, uniform: ("FULL", s, uniform))
    assert spec._build_attn_metadata(3, "vLLM's desc") == "vLLM's desc"
    assert spec._run_model(torch.zeros(3)) == "eager forward"
    with dg._replaying(spec, shape):
        assert spec._build_attn_metadata(num_reqs=3, batch_desc="vLLM's desc") == (
            "FULL", shape, True)
        assert spec._build_attn_metadata(3, "vLLM's desc") == ("FULL", shape, True)
        assert spec._run_model(torch.zeros(3)).tolist() == [0, 1, 2]  # the replay's rows
    assert graphs.replays == 1
    with pytest.raises(RuntimeError), dg._replaying(spec, shape):
        raise RuntimeError("drafter failed")
    assert spec._vllm_av_replay is None


def test_a_prefill_replays_metadata_states_the_bound_its_graph_was_captured_with(monkeypatch):
    """vLLM's build under a prefill replay gets the capture's longest query
    (as long as any replayed one can be); decode replays, eager builds and
    builds after the replay pass vLLM's own bound through."""
    kv = object()
    graphs = _graphs(kv)
    spec = _Spec(graphs, kv)
    seen = []

    def vllms_build(**kwargs):  # the speculator module's build_attn_metadata
        seen.append(kwargs["max_query_len"])

    def orig_build(self, num_reqs, batch_desc, **kwargs):  # vLLM's _build_attn_metadata
        dg.build_attn_metadata(max_query_len=2)  # the host layout's longest query

    module = SimpleNamespace(_orig_build_attn_metadata=vllms_build)
    monkeypatch.setattr(dg.importlib, "import_module", lambda name: module)
    monkeypatch.setattr(_Spec, "_orig__build_attn_metadata", orig_build)
    monkeypatch.setattr(dg, "_full_desc", lambda s, uniform: s)
    big, small = GraphShape("prefill", 24, 12), GraphShape("prefill", 4, 2)
    for shape in (big, small, GraphShape("decode", 4, 4)):
        with dg._replaying(spec, shape):
            spec._build_attn_metadata(3, "vLLM's desc")
    spec._build_attn_metadata(3, "vLLM's desc")  # eager
    dg.build_attn_metadata(max_query_len=2)  # another speculator's build
    assert seen == [K + 2, 4, 2, 2, 2]
    assert capture_query_lens(big, K + 2).max() == K + 2
    assert capture_query_lens(small, K + 2).max() == 4
