"""`vllm serve` with our AV on the GPU: 256 concurrent requests with client
aborts, bad input, and the adaptive-depth decision in /metrics.

Runs against a live server when VLLM_AV_TEST_SERVER_URL (and
VLLM_AV_TEST_SERVER_MODEL) name one: the GPU round passes the sweep's own
`ours` server after its benchmarks (benchmarks/sweep.py --after-arm-cmd), so
no second start-up is paid. Otherwise it starts one with the real pair
(TARGET_MODEL / DRAFT_MODEL) and is skipped without CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
requests = pytest.importorskip("requests")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving import av_metrics, completions_with_client_aborts, started_server  # noqa: E402

URL = os.environ.get("VLLM_AV_TEST_SERVER_URL", "")
TARGET = os.environ.get("VLLM_AV_TEST_SERVER_MODEL") or os.environ.get("TARGET_MODEL", "")
DRAFT = os.environ.get("DRAFT_MODEL", "")
if not URL:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (or VLLM_AV_TEST_SERVER_URL)", allow_module_level=True)
    if not (os.path.isdir(TARGET) and os.path.isdir(DRAFT)):
        pytest.skip("needs TARGET_MODEL and DRAFT_MODEL (bf16 folders)", allow_module_level=True)

NUM_REQUESTS, ABORT_EVERY = 256, 5


def ngram_arm_on_v1(arm: str) -> bool:
    """Whether the sweep's arm `arm` serves ngram on Model Runner V1 (its
    env pins V1); the served default and the `*_v2` arms run on V2, where
    ngram has adaptive depth too."""
    if not arm.startswith("ngram_"):
        return False
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import sweep

    return dict(sweep.make_arm(arm).env).get("VLLM_USE_V2_MODEL_RUNNER") == "0"
PROMPTS = ["def fibonacci(n):", "def is_prime(n):", "class Stack:", "def quicksort(xs):",
           "Explain what a hash map is.", "Write a haiku about the sea.",
           "def binary_search(a, x):", "What is the capital of France?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if URL:
        yield URL, TARGET
        return
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 7,
            "enable_adaptive_verification": True}
    args = [TARGET, "--max-model-len", "4096", "--max-num-seqs", "256",
            "--kv-cache-memory-bytes", str(8 << 30), "--speculative-config", json.dumps(spec)]
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0")
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with started_server(args, env, log_path, timeout_s=600) as base:
        yield base, TARGET


def test_256_concurrent_requests_with_client_aborts_finish_cleanly(server):
    base, model = server
    t0 = time.monotonic()
    done = completions_with_client_aborts(
        base, lambda i: {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 64,
                         "temperature": 1.0, "stream": i % 2 == 0},
        num_requests=NUM_REQUESTS, abort_every=ABORT_EVERY)
    print(f"{done} completed, {NUM_REQUESTS - done} aborted, {time.monotonic() - t0:.1f} s")
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    r = requests.post(f"{base}/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPTS[0], "max_tokens": 16})
    assert r.status_code == 200, r.text


def test_bad_request_gets_a_clear_error_and_the_server_keeps_serving(server):
    base, model = server
    r = requests.post(f"{base}/v1/completions", timeout=30,
                      json={"model": model, "prompt": "x", "max_tokens": -5})
    assert 400 <= r.status_code < 500, r.text
    r = requests.post(f"{base}/v1/completions", timeout=60,
                      json={"model": model, "prompt": PROMPTS[1], "max_tokens": 8})
    assert r.status_code == 200, r.text


def test_metrics_show_the_drafting_depth_decision(server):
    base, _ = server
    values = av_metrics(requests.get(f"{base}/metrics", timeout=10).text)
    print({k: v for k, v in values.items() if "depth" in k})
    assert "vllm_av:draft_depth" in values
    steps = values.get("vllm_av:depth_steps_total", 0)
    arm = os.environ.get("SWEEP_ARM", "")
    if ngram_arm_on_v1(arm):
        # ngram on V1 drafts K every step (adaptive depth there is for
        # draft models): no depth chosen, drafts made and budgeted.
        assert steps == 0 and values.get("vllm_av:draft_tokens_drafted_total", 0) > 0, values
        return
    assert steps > 0
    assert 0 <= values.get("vllm_av:zero_depth_steps_total", -1) <= steps
    # Per depth: every step at some depth 0..K, the depth-0 tally the same.
    by_depth = {k: v for k, v in values.items()
                if k.startswith("vllm_av:depth_chosen_steps_total{")}
    assert by_depth, sorted(values)
    # A scrape reads one snapshot: the tallies and the step count agree.
    assert sum(by_depth.values()) == steps
    assert values['vllm_av:depth_chosen_steps_total{depth="0"}'] == values.get(
        "vllm_av:zero_depth_steps_total")
