"""FULL graph keys for batches of any draft length (vllm_av/vllm/mrv1/graphs.py),
checked against vLLM's own dispatcher: which graph a batch is replayed in."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import CompilationConfig, CUDAGraphMode  # noqa: E402
from vllm.config.compilation import CompilationMode  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher  # noqa: E402

from vllm_av.vllm.config import ADDITIONAL_CONFIG_KEY, AVOptions  # noqa: E402
from vllm_av.vllm.mrv1.graphs import VarlenFullGraphsPatch, add_varlen_full_keys  # noqa: E402

K = 7
SIZES = [8, 16, 24, 32, 40, 48, 64]
MAX_SEQS = 32


def _dispatcher(mode=CUDAGraphMode.FULL_AND_PIECEWISE):
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode,
        cudagraph_capture_sizes=list(SIZES), max_cudagraph_capture_size=SIZES[-1],
    )
    cc.set_splitting_ops_for_v1(all2all_backend="", data_parallel_size=1)
    config = SimpleNamespace(
        compilation_config=cc, num_speculative_tokens=K, lora_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS),
    )
    d = CudagraphDispatcher(config)
    d.initialize_cudagraph_keys(mode, 1 + K)
    return d


def test_without_the_keys_short_steps_fall_to_piecewise():
    # The problem the patch exists for (negative control of the next test).
    d = _dispatcher()
    assert d.dispatch(1, uniform_decode=False)[0] == CUDAGraphMode.PIECEWISE
    assert d.dispatch(20, uniform_decode=False)[0] == CUDAGraphMode.PIECEWISE


def test_every_batch_up_to_the_largest_capture_size_gets_a_full_graph():
    d = _dispatcher()
    uniform_before = {n: d.dispatch(n, uniform_decode=True) for n in (8, 16, 64)}
    added = add_varlen_full_keys(d)
    assert [k.num_tokens for k in added] == sorted(SIZES, reverse=True)
    for n in range(1, SIZES[-1] + 1):
        mode, desc = d.dispatch(n, uniform_decode=False)
        assert mode == CUDAGraphMode.FULL, n
        assert desc.num_tokens >= n and not desc.uniform
        # Room for one request per token (a depth-0 step), within max_num_seqs.
        assert desc.num_reqs == min(desc.num_tokens, MAX_SEQS)
    # Uniform decode batches keep vLLM's own graphs; above the range, none.
    for n, before in uniform_before.items():
        assert d.dispatch(n, uniform_decode=True) == before
    assert d.dispatch(SIZES[-1] + 1, uniform_decode=False)[0] == CUDAGraphMode.NONE
    # vLLM's capture loop sees them.
    full = dict(d.get_capture_descs())[CUDAGraphMode.FULL]
    assert sum(not k.uniform for k in full) == len(SIZES)
    assert add_varlen_full_keys(d) == []  # idempotent


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL, CUDAGraphMode.NONE])
def test_other_modes_are_left_alone(mode):
    d = _dispatcher(mode) if mode != CUDAGraphMode.NONE else _dispatcher()
    if mode == CUDAGraphMode.NONE:
        d.cudagraph_mode = mode
    before = {m: set(k) for m, k in d.cudagraph_keys.items()}
    assert add_varlen_full_keys(d) == []
    assert {m: set(k) for m, k in d.cudagraph_keys.items()} == before


def _fake_backend(support, name="FLASH_ATTN"):
    builder = SimpleNamespace(get_cudagraph_support=lambda *a: support)
    return SimpleNamespace(get_builder_cls=lambda: builder, get_name=lambda: name)


class _Runner:
    """What the patch reads of vLLM's GPU model runner; vLLM's capture pass
    is recorded instead of run (it needs a GPU)."""

    def __init__(self, options, support, backend="FLASH_ATTN"):
        extra = {} if options is None else {ADDITIONAL_CONFIG_KEY: options.to_dict()}
        self.vllm_config = SimpleNamespace(
            additional_config=extra, scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS)
        )
        self.cudagraph_dispatcher = _dispatcher()
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=None)])
        self.attn_groups = [[SimpleNamespace(backend=_fake_backend(support, backend),
                                             kv_cache_spec=None)]]
        self.calls = []

    def _orig_capture_model(self):
        # vLLM's own capture runs first, while the dispatcher still sends
        # mixed batches to the piecewise graphs (its drafter graphs are
        # captured in that pass, and its checks require it).
        self.calls.append(("vllm", self.cudagraph_dispatcher.dispatch(3)[0]))
        return 7


@pytest.mark.parametrize(
    "options, support, backend, expect_keys",
    [
        (AVOptions(), AttentionCGSupport.ALWAYS, "FLASH_ATTN", True),
        # FA2, FlashInfer-like
        (AVOptions(), AttentionCGSupport.UNIFORM_BATCH, "FLASH_ATTN", False),
        # Declares ALWAYS but crashed on the H200 (float32 pair): not validated.
        (AVOptions(), AttentionCGSupport.ALWAYS, "TRITON_ATTN", False),
        (AVOptions(varlen_full_graphs=False), AttentionCGSupport.ALWAYS, "FLASH_ATTN", False),
        (None, AttentionCGSupport.ALWAYS, "FLASH_ATTN", False),  # our AV not serving
    ],
)
def test_the_patch_captures_after_vllm_and_only_where_it_should(
    monkeypatch, options, support, backend, expect_keys
):
    import vllm_av.vllm.mrv1.graphs as graphs

    runner = _Runner(options, support, backend)
    monkeypatch.setattr(
        graphs, "capture_full",
        lambda r, keys: r.calls.append(("ours", [k.num_tokens for k in keys])),
    )
    assert VarlenFullGraphsPatch.capture_model(runner) == 7
    assert runner.calls[0] == ("vllm", CUDAGraphMode.PIECEWISE)
    mode, _ = runner.cudagraph_dispatcher.dispatch(3, uniform_decode=False)
    assert (mode == CUDAGraphMode.FULL) == expect_keys
    if expect_keys:
        assert runner.calls[1] == ("ours", sorted(SIZES, reverse=True))
    else:
        assert len(runner.calls) == 1


def test_a_failed_capture_leaves_vllm_graphs_in_charge(monkeypatch):
    import vllm_av.vllm.mrv1.graphs as graphs

    runner = _Runner(AVOptions(), AttentionCGSupport.ALWAYS)

    def broken(r, keys):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(graphs, "capture_full", broken)
    assert VarlenFullGraphsPatch.capture_model(runner) == 7
    mode, _ = runner.cudagraph_dispatcher.dispatch(3, uniform_decode=False)
    assert mode == CUDAGraphMode.PIECEWISE
    assert runner.cudagraph_dispatcher.dispatch(16, uniform_decode=True)[0] == CUDAGraphMode.FULL
