"""`vllm serve` with our AV on: the OpenAI endpoints, /metrics, bad input
and a 256-request load with client aborts.

One server for the whole module (tiny models, steep cost table so that the
budget binds under load).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys

import pytest

pytest.importorskip("vllm")
aiohttp = pytest.importorskip("aiohttp")
requests = pytest.importorskip("requests")

from test_av_engine import steep_cost_table  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from serving import av_metrics, completions_with_client_aborts, started_server  # noqa: E402

K = 7
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    env = dict(os.environ)
    env.update(
        VLLM_AV_COST_TABLE=steep_cost_table(tmp / "steep.json"),
        VLLM_AV_CALIBRATE_COSTS="0",
        VLLM_AV_METRICS_INTERVAL="1",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    spec = {
        "method": "draft_model",
        "model": str(tiny_models.draft),
        "num_speculative_tokens": K,
        "enable_adaptive_verification": True,
    }
    args = [
        str(tiny_models.target),
        "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "64",
        "--enforce-eager", "--chat-template", str(tmp / "chat.jinja"),
        "--speculative-config", json.dumps(spec),
    ]
    with started_server(args, env, tmp / "server.log", STARTUP_TIMEOUT_S) as base:
        yield base, str(tiny_models.target)


def _prompt(seed: int, n: int = 6) -> str:
    from tiny_models import _words

    rng = random.Random(seed)
    words = _words(61)
    return " ".join(rng.choice(words) for _ in range(n))


def test_completions_chat_and_streaming_answer(server):
    base, model = server
    r = requests.post(f"{base}/v1/completions", json={
        "model": model, "prompt": _prompt(1), "max_tokens": 12, "temperature": 0,
    }, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1

    r = requests.post(f"{base}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": _prompt(2)}],
        "max_tokens": 12, "temperature": 1.0,
    }, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None

    with requests.post(f"{base}/v1/completions", json={
        "model": model, "prompt": _prompt(3), "max_tokens": 16, "temperature": 0,
        "stream": True, "ignore_eos": True,
    }, stream=True, timeout=60) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    assert chunks[-1] == b"data: [DONE]"
    assert len(chunks) >= 3  # several deltas, then [DONE]


def test_metrics_expose_av_counters(server):
    base, model = server
    requests.post(f"{base}/v1/completions", json={
        "model": model, "prompt": _prompt(4), "max_tokens": 24, "ignore_eos": True,
    }, timeout=60)
    values = av_metrics(requests.get(f"{base}/metrics", timeout=10).text)
    for name in ("drafted", "verified", "accepted", "trimmed"):
        assert f"vllm_av:draft_tokens_{name}_total" in values, sorted(values)
    assert values["vllm_av:draft_tokens_drafted_total"] > 0
    assert "vllm_av:budget" in values
    assert "vllm_av:draft_depth" in values
    # The depth decision per step (adaptive depth is on by default): a tally
    # per depth that adds up to the steps whose depth was chosen.
    by_depth = {k: v for k, v in values.items()
                if k.startswith("vllm_av:depth_chosen_steps_total{")}
    assert by_depth and sum(by_depth.values()) == values["vllm_av:depth_steps_total"] > 0
    assert "vllm_av:estimator_slope" in values
    assert any(k.startswith('vllm_av:estimator_intercept{position="0"}') for k in values)
    assert any(k.startswith('vllm_av:acceptance_observed{position="0"}') for k in values)


def test_malformed_requests_get_400_and_the_server_keeps_serving(server):
    base, model = server
    bad = [
        ("not json", {"data": b"{not json", "headers": {"Content-Type": "application/json"}}),
        ("negative max_tokens", {"json": {"model": model, "prompt": "x", "max_tokens": -5}}),
        ("bad temperature", {"json": {"model": model, "prompt": "x", "temperature": -1}}),
    ]
    for what, kwargs in bad:
        r = requests.post(f"{base}/v1/completions", timeout=30, **kwargs)
        assert 400 <= r.status_code < 500, (what, r.status_code, r.text)
    r = requests.post(f"{base}/v1/completions", json={
        "model": model, "prompt": _prompt(5), "max_tokens": 8,
    }, timeout=60)
    assert r.status_code == 200, r.text


def test_256_concurrent_requests_with_client_aborts_finish_cleanly(server):
    base, model = server
    completions_with_client_aborts(
        base, lambda i: {"model": model, "prompt": _prompt(100 + i), "max_tokens": 24,
                         "temperature": 1.0, "ignore_eos": True, "stream": i % 2 == 0},
        num_requests=256, abort_every=5)
    # Still healthy and serving, and the load made the budget bind.
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    r = requests.post(f"{base}/v1/completions", json={
        "model": model, "prompt": _prompt(7), "max_tokens": 8,
    }, timeout=60)
    assert r.status_code == 200
    text = requests.get(f"{base}/metrics", timeout=10).text
    trimmed = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm_av:draft_tokens_trimmed_total")]
    assert trimmed and trimmed[0] > 0
