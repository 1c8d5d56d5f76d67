"""A step that replays Model Runner V2's varlen AV graph builds its attention
metadata at the graph's capture bound (vllm_av/vllm/mrv2/replay_bound.py).

vLLM 0.32's own `CudaGraphManager.dispatch` picks the graph here, on a
manager built without a GPU (tests/vllm/test_mrv2_uniform_graphs.py); the
runner's `prepare_inputs` is stood in for by a stub, with our patch around
it. Whether the metadata then gives the right distribution needs the H200
(tests/gpu/test_gpu_lossless.py, depth alternating 0 and K).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # noqa: E402

from test_mrv2_uniform_graphs import K, manager  # noqa: E402
from vllm_av.vllm.config import ADDITIONAL_CONFIG_KEY, AVOptions  # noqa: E402
from vllm_av.vllm.mrv2.replay_bound import MRV2ReplayBoundPatch, replay_bound  # noqa: E402
from vllm_av.vllm.mrv2.uniform_graphs import MRV2UniformDecodeGraphsPatch  # noqa: E402
from vllm_av.vllm.patching import apply_patch, revert_patch  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def patched():
    apply_patch(MRV2UniformDecodeGraphsPatch)
    apply_patch(MRV2ReplayBoundPatch)
    yield
    revert_patch(MRV2ReplayBoundPatch)
    revert_patch(MRV2UniformDecodeGraphsPatch)


def depth_zero_step(graphs):
    """The descriptor a step of 16 one-token queries (depth 0) replays."""
    return graphs.dispatch(num_reqs=16, num_tokens=16, uniform_token_count=1,
                           num_active_loras=0, max_query_len=1)


def test_a_depth_zero_step_on_the_varlen_graph_is_built_at_its_capture_bound():
    desc = depth_zero_step(manager(uniform_decode_graphs=False))
    assert desc.cg_mode == CUDAGraphMode.FULL and desc.uniform_token_count is None
    assert replay_bound(desc, None) == K + 1
    # A depth-1 step (two tokens per request, drafts scheduled): the same.
    assert replay_bound(desc, 2) == K + 1


def test_steps_on_their_own_graphs_keep_their_bound():
    # A uniform one-token graph (option uniform_decode_graphs) was captured
    # at one token: nothing to raise.
    desc = depth_zero_step(manager(uniform_decode_graphs=True))
    assert desc.uniform_token_count == 1 and replay_bound(desc, None) is None
    # A prefill (no bound passed to dispatch) replays no FULL graph.
    graphs = manager(uniform_decode_graphs=False)
    desc = graphs.dispatch(num_reqs=2, num_tokens=16, uniform_token_count=None,
                           num_active_loras=0, max_query_len=None)
    assert desc.cg_mode != CUDAGraphMode.FULL and replay_bound(desc, 3) == 3


def runner(ours: bool):
    r = GPUModelRunner.__new__(GPUModelRunner)
    extra = {ADDITIONAL_CONFIG_KEY: AVOptions().to_dict()} if ours else {}
    r.vllm_config = SimpleNamespace(additional_config=extra)
    r.pcp_manager = None
    return r


@pytest.mark.parametrize("ours", [True, False])
def test_prepare_inputs_hands_the_bound_to_the_metadata_with_our_av_only(monkeypatch, ours):
    laid_out = SimpleNamespace(max_query_len=None)
    monkeypatch.setattr(GPUModelRunner, "_orig_prepare_inputs",
                        lambda self, *a, **k: laid_out, raising=False)
    desc = depth_zero_step(manager(uniform_decode_graphs=False))
    batch = GPUModelRunner.prepare_inputs(runner(ours), None, None, desc, 0)
    assert batch is laid_out
    # vLLM's own AV schedules K drafts on every decode step: left as it is.
    assert batch.max_query_len == (K + 1 if ours else None)
