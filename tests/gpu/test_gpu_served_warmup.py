"""Our served-kernel warm-up on the GPU: an engine of ours compiles none of
the spec-decode kernels it serves with after start-up.

Skipped without CUDA or vLLM. Three engines of ours on the tiny test pair
in bfloat16 (scripts/gpu/jit_check.py), every step drafting K: one with
the warm-up (the default), one without it (VLLM_AV_SERVED_KERNEL_WARMUP=0,
the negative control: vLLM's warm-up leaves the rejection kernels for
unprocessed bfloat16 logits and our estimator's observation to the first
served steps), and one with the warm-up and a single request slot
(max_num_seqs 1: vLLM's mixed warm-up step cannot run, ours warms the
drafter's first forward with one request's prompts). That one alone sizes
its KV cache by vLLM's memory profile, which captures only the largest FULL
graphs before our cost profile steps at their sizes: it also checks that
no step is sent to a graph the profile did not capture (our two-token
graph, once). vLLM's own top-p kernels are not counted: plain V2 compiles
them while serving too.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
OURS_TO_WARM = {"_compute_local_logits_stats_kernel", "_rejection_kernel", "_resample_kernel",
                "_prepare_prefill_inputs_kernel", "_observe_kernel"}


def _jit_check():
    spec = importlib.util.spec_from_file_location("jit_check", ROOT / "scripts/gpu/jit_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from tiny_models import build_tiny_models

    models = build_tiny_models(tmp_path_factory.mktemp("tiny_models"))
    check = _jit_check()
    t0 = time.perf_counter()
    procs = {v: check.start_variant(v, str(models.target), str(models.draft), 3, 256, "bfloat16")
             for v in ("on", "off", "one_slot")}
    out = {v: check.finish_variant(v, p, t0, 600) for v, p in procs.items()}
    for r in out.values():
        print(r["variant"], r["rc"], r["start_s"], r["compiled_while_serving"], r["served_warmup"])
    return out


def _ours(names):
    return OURS_TO_WARM.intersection(names)


def test_with_the_warm_up_nothing_of_ours_compiles_while_serving(compiled):
    on = compiled["on"]
    assert on["rc"] == 0 and on["served"], on["log_tail"]
    assert on["served_warmup"], "the served-kernel warm-up did not run"
    assert not _ours(on["compiled_while_serving"]), on["compiled_lines"]


def test_without_it_the_rejection_kernels_compile_while_serving(compiled):
    # Negative control: the check sees what the warm-up removes.
    off = compiled["off"]
    assert off["rc"] == 0 and off["served"], off["log_tail"]
    assert {"_rejection_kernel", "_resample_kernel"} <= _ours(off["compiled_while_serving"])


def test_with_one_request_slot_the_prompts_warm_and_nothing_of_ours_compiles(compiled):
    one = compiled["one_slot"]
    assert one["rc"] == 0 and one["served"], one["log_tail"]
    assert "one request's prompt each" in (one["served_warmup"] or ""), one["served_warmup"]
    assert not _ours(one["compiled_while_serving"]), one["compiled_lines"]
