"""Uniform FULL graphs (one and two tokens per request) beside Model Runner
V2's varlen AV graphs (vllm_av/vllm/mrv2/uniform_graphs.py).

vLLM 0.32's own `CudaGraphManager._init_candidates` and `dispatch` run here
on a manager built without a GPU (only the attributes they read), with our
patch applied: which graph each kind of step would replay, and what would be
captured. Capturing and replaying need the H200 (tests/gpu/test_gpu_av.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager  # noqa: E402

from vllm_av.vllm.config import AVOptions  # noqa: E402
from vllm_av.vllm.mrv2.uniform_graphs import MRV2UniformDecodeGraphsPatch  # noqa: E402
from vllm_av.vllm.patching import apply_patch, revert_patch  # noqa: E402

K = 7
MAX_REQS = 16
SIZES = [1, 2, 4, 8, 16, 32, 64]  # the last two hold more tokens than requests


@pytest.fixture(scope="module", autouse=True)
def patched():
    apply_patch(MRV2UniformDecodeGraphsPatch)
    yield
    revert_patch(MRV2UniformDecodeGraphsPatch)


def manager(uniform_decode_graphs: bool, varlen_decode: bool = True, k: int = K,
            max_reqs: int = MAX_REQS, sizes=SIZES) -> CudaGraphManager:
    """A V2 graph manager as the runner builds it with AV on (varlen decode,
    FULL_AND_PIECEWISE, k+1 query tokens per request), graphs 'captured'."""
    m = CudaGraphManager.__new__(CudaGraphManager)
    spec = SimpleNamespace(uses_dynamic_speculative_decoding=lambda: False)
    m.vllm_config = SimpleNamespace(
        speculative_config=spec, num_speculative_tokens=k,
        cache_config=SimpleNamespace(use_kda_recoverssm=False),
        additional_config={"vllm_av": AVOptions(
            uniform_decode_graphs=uniform_decode_graphs).to_dict()})
    m.compilation_config = SimpleNamespace(cudagraph_capture_sizes=sizes,
                                           max_cudagraph_capture_size=max(sizes))
    m.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    m.max_num_reqs = max_reqs
    m.decode_query_len = k + 1
    m.varlen_decode = varlen_decode
    m.lora_capture_cases = [0]
    m._lora_dispatch_map, m._max_lora_case = {}, 0
    m.ubatch_runner = None
    m._candidates, m._capture_descs = {}, {}
    m._init_candidates()
    m._graphs_captured = True
    return m


def step(m, num_reqs, tokens_per_req, scheduled_max=None):
    """The graph a step replays; `scheduled_max`: the scheduler's largest
    query length (drafts included; what the runner passes), or None for a
    step with a prompt."""
    uniform = tokens_per_req if isinstance(tokens_per_req, int) else None
    lens = [tokens_per_req] * num_reqs if uniform else tokens_per_req
    return m.dispatch(num_reqs, sum(lens), uniform, 0, max_query_len=scheduled_max)


def test_depth_zero_step_replays_a_one_token_graph():
    m = manager(True)
    for r in (1, 3, 5, 16):
        d = step(m, r, 1, scheduled_max=1)
        assert d.cg_mode == CUDAGraphMode.FULL and d.uniform_token_count == 1, (r, d)
        assert d.max_query_len == 1 and d.num_reqs >= r and d.num_tokens >= r


def test_depth_one_step_with_every_draft_admitted_replays_a_two_token_graph():
    m = manager(True)
    for r in (1, 3, 8, 16):
        d = step(m, r, 2, scheduled_max=2)
        assert d.cg_mode == CUDAGraphMode.FULL and d.uniform_token_count == 2, (r, d)
        assert d.max_query_len == 2 and d.num_reqs >= r and d.num_tokens >= 2 * r


def test_steps_with_drafts_trimmed_or_deeper_keep_the_varlen_graph():
    m = manager(True)
    # Drafts scheduled but none admitted: one token each, the scheduler's bound K+1.
    d = step(m, 4, 1, scheduled_max=K + 1)
    assert d.cg_mode == CUDAGraphMode.FULL and d.uniform_token_count is None
    assert d.max_query_len == K + 1
    # Depth 2 with a budget of one draft per request: the host's layout is
    # two tokens each, the device's may not be; the scheduler's bound is 3.
    d = step(m, 4, 2, scheduled_max=3)
    assert d.uniform_token_count is None and d.max_query_len == K + 1, d
    # Depth 1 with some drafts trimmed, a mix of draft lengths, depth K.
    for lens, bound in (([2, 1, 2], 2), ([1, 3, 2, 1], 3), ([K + 1] * 2, K + 1)):
        d = step(m, len(lens), lens, scheduled_max=bound)
        assert d.cg_mode == CUDAGraphMode.FULL and d.max_query_len == K + 1, (lens, d)


def test_prompt_steps_are_left_to_the_mixed_graphs():
    d = step(manager(True), 4, [5, 1, 1, 1], scheduled_max=None)
    assert d.cg_mode == CUDAGraphMode.PIECEWISE


def test_negative_control_without_the_option_depth_zero_and_one_replay_the_varlen_graph():
    m = manager(False)
    for tokens in (1, 2):
        d = step(m, 3, tokens, scheduled_max=tokens)
        assert d.uniform_token_count is None and d.max_query_len == K + 1, d
    # Without varlen decode (no AV) the option adds nothing of its own.
    plain = manager(True, varlen_decode=False)
    assert not any(x.max_query_len == 1 for x in plain._capture_descs.get(CUDAGraphMode.FULL, []))


def test_uniform_graphs_are_captured_once_per_size_that_fits_the_requests():
    off, on = manager(False), manager(True)
    before = off._capture_descs[CUDAGraphMode.FULL]
    after = on._capture_descs[CUDAGraphMode.FULL]
    for u in (1, 2):
        twins = [d for d in after if d.uniform_token_count == u]
        # One per captured size holding a whole number of u-token requests,
        # at most MAX_REQS of them.
        want = [s for s in SIZES if s % u == 0 and s // u <= MAX_REQS]
        assert sorted(d.num_tokens for d in twins) == want, u
        assert all(d.num_reqs * u == d.num_tokens and d.max_query_len == u for d in twins)
    twins = [d for d in after if d.uniform_token_count is not None]
    assert set(before) <= set(after) and len(after) == len(before) + len(twins)
    # Largest first, as vLLM captures them; and PIECEWISE untouched.
    assert [d.num_tokens for d in after] == sorted((d.num_tokens for d in after), reverse=True)
    assert on._capture_descs[CUDAGraphMode.PIECEWISE] == off._capture_descs[CUDAGraphMode.PIECEWISE]
    # Calling it again (vLLM re-inits after releasing graphs) adds nothing twice.
    on._init_candidates()
    assert len(on._capture_descs[CUDAGraphMode.FULL]) == len(after)


def captured_largest(limit):
    """vLLM's capture as its memory profile runs it: only the `limit`
    largest FULL descriptors get a graph (`_max_full_descs_to_capture`)."""
    def capture(self, *args, **kwargs):
        self.graphs = {d: object() for d in self._capture_descs[CUDAGraphMode.FULL][:limit]}
    return capture


# vLLM's default capture sizes, as far as a decode batch of up to 256
# requests of K + 1 tokens reaches.
DEFAULT_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 1025, 16))


def profiled_steps_reach_captured_graphs(m) -> list:
    """Each size with a FULL graph, stepped as vLLM's dummy run lays it out
    (min(size, slots) requests, the tokens dealt evenly): the descriptors
    dispatched that have no graph."""
    missing = []
    for n in sorted({d.num_tokens for d in m.graphs}):
        reqs = min(n, m.max_num_reqs)
        uniform = n // reqs if n % reqs == 0 else None
        d = m.dispatch(reqs, n, uniform, 0, max_query_len=-(-n // reqs))
        if d.cg_mode == CUDAGraphMode.FULL and d not in m.graphs:
            missing.append(d)
    return missing


@pytest.mark.parametrize("k,slots", [(3, 1), (3, 2), (3, 4), (1, 8), (5, 2), (7, 1), (7, 64)])
@pytest.mark.parametrize("limit", [2, None])
def test_after_a_capture_every_step_dispatches_to_a_captured_graph(monkeypatch, limit, k, slots):
    # vLLM's memory profile captures the two largest FULL graphs (limit 2),
    # then our cost profile steps at each captured size; with few request
    # slots a uniform twin can share the second largest size (one slot and
    # K = 3: 4, 2 and 1 tokens, the two-token twin second largest).
    monkeypatch.setitem(MRV2UniformDecodeGraphsPatch._originals, "capture",
                        captured_largest(limit))
    sizes = [s for s in DEFAULT_SIZES if s <= slots * (k + 1)]
    m = manager(True, k=k, max_reqs=slots, sizes=sizes)
    m.capture()
    assert len(m.graphs) == (2 if limit else len(m._capture_descs[CUDAGraphMode.FULL]))
    assert profiled_steps_reach_captured_graphs(m) == []
    if limit is None:  # a full capture keeps the twins first
        assert step(m, 1, 1, scheduled_max=1).uniform_token_count == 1
        if k > 1:
            assert step(m, 1, 2, scheduled_max=2).uniform_token_count == 2


@pytest.mark.parametrize("k,slots", [(3, 1), (3, 2), (3, 4), (1, 8), (5, 2)])
def test_negative_control_without_the_filter_the_profile_dispatches_to_no_graph(k, slots):
    sizes = [s for s in DEFAULT_SIZES if s <= slots * (k + 1)]
    m = manager(True, k=k, max_reqs=slots, sizes=sizes)
    captured_largest(2)(m)  # vLLM's capture alone, candidates left as built
    missing = profiled_steps_reach_captured_graphs(m)
    assert missing and all(d.uniform_token_count is not None for d in missing)
