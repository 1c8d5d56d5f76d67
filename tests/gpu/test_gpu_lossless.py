"""Our AV emits the target's own distribution on the GPU too.

The CPU distribution test (tests/vllm/test_lossless_cpu.py, whose helpers
and statistics this reuses) run on CUDA with the same tiny random-weight
Llama pair: at temperature 1, the first three tokens of N = 8000 samples of
one prompt, drawn through our AV on Model Runner V1 with CUDA graphs and a
cost table under which the budget trims part of every step, must follow
the exact target distribution (computed with transformers in float32).
Twice with synchronous scheduling (per-slot trimming): in float32 (vLLM
picks Triton or Flex attention; the test is exact) and in bfloat16
(FlashAttention 3, with our FULL graphs for steps of any draft length); and
once with async scheduling in bfloat16, the default on one GPU (depth
chosen when each step is scheduled, every draft verified); and on Model
Runner V2 through our MRV2 path in bfloat16: with the drafter's KV kept
whole at depth 0, and with the depth forced to alternate 0 and K, over
the holes depth-0 steps leave, with them caught up, and with the drafter
run at depth 0; then the parts apart: alternating with every draft
verified, and depth K on every step under trimming; and depths K, 0, 0
in turn, whose last step verifies and drafts nothing and so ends as plain
decoding; and the same cycle with target steps building no metadata for
the draft's layers, with a draft whose heads differ from the target's;
and with V2's other speculators instead of the draft model: EAGLE (a
random tiny EAGLE head) as served and at depths 0, 1, K, 2, MTP (a tiny
MiMo target's own layer) at those depths, DSpark with its trained
confidence head, and DFlash. Four chi-square
tests at ALPHA = 1e-5 per run: false-positive rate at most 4e-5 in float32. In bfloat16 the
engine's target is the float32 one rounded: computed on the CPU, the
rounding gives noncentralities of 0.8-5.2 at N = 8000, which lift each
test's false-positive rate to at most 3.9e-5 (1.6e-4 for the run;
tests/vllm/test_bf16_resolution.py keeps this checked on the CPU; the
GPU's kernels round differently, assumed of the same order, not measured).
Negative control, in bfloat16: the same engine with a token-dependent
admission rule (VLLM_AV_TEST_LOSSY_ADMISSION) must be caught (p < ALPHA on
token 2 or the joint of tokens 1-2), which shows the test has power on
this device and configuration.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("scipy.stats")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm"))

from test_lossless_cpu import (  # noqa: E402
    ALPHA, K, LONG_PROMPT, NUM_SAMPLES, NUM_TOKENS, PROMPT, p_values)

SAMPLE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    cfg = json.loads(sys.argv[1])
    plain, skipped_meta = [0], [0]
    if cfg.get("alternate_depth"):
        # Depths in a cycle, 0, K, 0, K, ... unless given (in-process engine
        # core): a schedule that reads no token, so the output must still
        # be the target's. Steps that end as plain decoding are counted.
        sys.path.insert(0, cfg["helpers"])
        from forced_depth import count_draft_metadata_skips, count_plain_steps, force_depth_cycle
        force_depth_cycle(cfg.get("depth_cycle", "0,K"))
        plain = count_plain_steps()
        skipped_meta = count_draft_metadata_skips()
    llm = LLM(model=cfg["target"], dtype=cfg["dtype"], max_model_len=256, max_num_seqs=64,
              gpu_memory_utilization=0.15, seed=0, async_scheduling=cfg["async"],
              speculative_config={"method": cfg["method"],
                                  # MTP: the layer is in the target's checkpoint.
                                  **({} if cfg["method"] == "mtp" else {"model": cfg["draft"]}),
                                  "num_speculative_tokens": cfg["k"],
                                  **({"draft_sample_method": "probabilistic"}
                                     if cfg["method"] == "draft_model" else {}),
                                  "enable_adaptive_verification": True})
    sp = SamplingParams(temperature=1.0, max_tokens=cfg["n_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": cfg["prompt"]}] * cfg["n"], sp, use_tqdm=False)
    print(f"PLAIN_STEPS {plain[0]}")
    print(f"DRAFT_METADATA_SKIPS {skipped_meta[0]}")
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids[:cfg["n_tokens"]]) for o in outs]))
    """
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="module")
def exact(models):
    from tiny_models import first_tokens_distribution

    return first_tokens_distribution(models.target, PROMPT, NUM_TOKENS).numpy()


@pytest.fixture(scope="module")
def cost_table(tmp_path_factory):
    # Same shape as the CPU test's: verification gets dearer past 64 tokens
    # per step, so at 64 concurrent samples the budget admits part of each
    # step's drafts.
    from vllm_av.core.cost_model import CostModel

    path = tmp_path_factory.mktemp("gpu_lossless") / "cost.json"
    verify = {1: [10.0], 64: [12.0], 128: [14.0], 192: [18.0], 256: [40.0], 512: [100.0]}
    path.write_text(CostModel.from_samples(verify, {1: [1.0]}).to_json())
    return path


@pytest.fixture(scope="module")
def flat_cost_table(tmp_path_factory):
    # Verification as cheap at 512 tokens as at one: the budget admits
    # every draft, so nothing is trimmed.
    from vllm_av.core.cost_model import CostModel

    path = tmp_path_factory.mktemp("gpu_lossless_flat") / "cost.json"
    verify = {n: [10.0] for n in (1, 64, 128, 256, 512)}
    path.write_text(CostModel.from_samples(verify, {1: [1.0]}).to_json())
    return path


def sample(models, cost_table, metrics_dir, lossy: bool, dtype: str,
           async_scheduling: bool | None = False, env_extra: dict | None = None,
           alternate_depth: bool | str = False, prompt: list[int] = PROMPT,
           counts: dict | None = None, method: str = "draft_model") -> np.ndarray:
    """`alternate_depth`: True for depths 0, K in turn, or the cycle as
    "K,0,0"; `counts` gets the steps that ended as plain decoding there;
    `method`: the drafter (`eagle`: `models.draft` is an EAGLE head)."""
    env = dict(os.environ, VLLM_USE_V2_MODEL_RUNNER="0", VLLM_AV_IMPL="ours",
               VLLM_AV_COST_TABLE=str(cost_table), VLLM_AV_CALIBRATE_COSTS="0",
               VLLM_AV_METRICS_DIR=str(metrics_dir),
               VLLM_AV_METRICS_INTERVAL="1")
    env.update(env_extra or {})
    if lossy:
        env.update(VLLM_AV_TEST_LOSSY_ADMISSION="1", VLLM_AV_ADAPTIVE_DEPTH="0")
    if alternate_depth:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cfg = {"target": str(models.target), "draft": str(models.draft), "k": K,
           "prompt": prompt, "n": NUM_SAMPLES, "n_tokens": NUM_TOKENS, "dtype": dtype,
           "async": async_scheduling, "alternate_depth": bool(alternate_depth), "method": method,
           "helpers": str(HERE.parent / "vllm")}
    if isinstance(alternate_depth, str):
        cfg["depth_cycle"] = alternate_depth
    proc = subprocess.run([sys.executable, "-c", SAMPLE, json.dumps(cfg)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    if counts is not None:
        for key in ("PLAIN_STEPS", "DRAFT_METADATA_SKIPS"):
            counts[key.lower()] = int(next(l.split()[1] for l in proc.stdout.splitlines()
                                           if l.startswith(key + " ")))
    return np.array(json.loads(lines[-1][len("RESULT "):]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_our_av_on_gpu_matches_target_distribution(models, exact, cost_table, tmp_path, dtype):
    from vllm_av.vllm.metrics import read_snapshot

    tokens = sample(models, cost_table, tmp_path / "metrics", lossy=False, dtype=dtype)
    pvals = p_values(tokens, exact)
    stats = read_snapshot(str(tmp_path / "metrics"))
    print(f"GPU AV ({dtype}): N={len(tokens)} chi-square p-values {pvals}; AV counters {stats}")
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and 0 < stats["trimmed"] < stats["drafted"], stats


def test_our_av_with_async_scheduling_on_gpu_matches_target_distribution(
    models, exact, cost_table, tmp_path
):
    """The default on one GPU: async scheduling, the drafting depth chosen
    when each step is scheduled and every draft verified (no trimming), in
    bfloat16. Same statistic, sample size and threshold as the synchronous
    runs, whose negative control below shows its power on this device."""
    from vllm_av.vllm.metrics import read_snapshot

    tokens = sample(models, cost_table, tmp_path / "metrics", lossy=False, dtype="bfloat16",
                    async_scheduling=True)
    pvals = p_values(tokens, exact)
    stats = read_snapshot(str(tmp_path / "metrics"))
    print(f"GPU AV async (bfloat16): N={len(tokens)} chi-square p-values {pvals}; "
          f"AV counters {stats}")
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["verified"] > 0, stats  # drafts were verified


def test_our_av_on_model_runner_v2_matches_target_distribution(models, exact, cost_table, tmp_path):
    """Our AV on Model Runner V2 (`VLLM_AV_MRV2=1`: our estimator with its
    fused kernels, our manager and selector, adaptive depth with the
    drafter's KV cache kept, the drafter in our CUDA graphs), bfloat16, the
    engine's default scheduling. Same statistic, sample size and threshold
    as above (false-positive rate at most 1.6e-4 for the run in bfloat16);
    the negative control below runs on V1, as V2 has no lossy-admission
    hook, and shows the statistic's power on this device."""
    pvals, stats = _sample_on_v2(models, exact, cost_table, tmp_path, "MRV2",
                                 {"VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "0"})
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["verified"] > 0 and stats["depth_steps"] > 0, stats


def _sample_on_v2(models, exact, cost_table, tmp_path, label, env, alternate_depth=False,
                  prompt=PROMPT, method="draft_model"):
    """Samples through our AV on Model Runner V2 in bfloat16 with `env`
    set: (p-values against `exact`, the distribution after `prompt`; our
    metrics snapshot, with the plain steps counted under a forced depth
    cycle)."""
    from vllm_av.vllm.metrics import read_snapshot

    counts: dict = {}
    tokens = sample(models, cost_table, tmp_path / "metrics", lossy=False, dtype="bfloat16",
                    async_scheduling=None, alternate_depth=alternate_depth, prompt=prompt,
                    env_extra={"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_AV_MRV2": "1", **env},
                    counts=counts, method=method)
    pvals = p_values(tokens, exact)
    stats = read_snapshot(str(tmp_path / "metrics"))
    if stats is not None:
        stats.update(counts)
    print(f"GPU AV on {label} (bfloat16): N={len(tokens)} chi-square p-values {pvals}; "
          f"AV counters {stats}")
    return pvals, stats


def test_our_av_on_model_runner_v2_with_an_eagle_head_matches_target_distribution(
        models, exact, cost_table, tmp_path):
    """vLLM's V2 EAGLE speculator (a random tiny EAGLE head over the
    target's hidden states, tests/vllm/tiny_models.py) under our V2 manager,
    estimator and budget, with CUDA graphs, as served: adaptive depth
    chooses each step's depth (vllm_av/vllm/mrv2/target_drafter.py) and the
    budget trims."""
    from tiny_models import build_eagle_draft

    pvals, stats = _sample_on_v2(build_eagle_draft(models), exact, cost_table, tmp_path,
                                 "MRV2 with EAGLE", {}, method="eagle")
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["verified"] > 0 and stats["trimmed"] > 0, stats


def test_eagle_at_every_depth_on_model_runner_v2_matches_target_distribution(
        models, exact, cost_table, tmp_path):
    """The EAGLE head at depths 0, 1, K, 2 in turn (a schedule that reads
    no token): depth 0 runs its first forward alone, depth 2 replays the
    fused decode loop's graph captured for depth 2
    (MRV2TargetDrafterGraphsPatch), and the slots past each depth carry
    the prior (MRV2TargetDrafterDepthPatch). Same statistic and threshold
    as above."""
    from tiny_models import build_eagle_draft

    pvals, stats = _sample_on_v2(build_eagle_draft(models), exact, cost_table, tmp_path,
                                 "MRV2 with EAGLE, depths 0,1,K,2", {}, method="eagle",
                                 alternate_depth="0,1,K,2")
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["verified"] > 0, stats
    assert stats["zero_depth_steps"] > 0 and stats["depth_steps"] > stats["zero_depth_steps"], stats


def test_mtp_at_every_depth_on_model_runner_v2_matches_target_distribution(
        cost_table, tmp_path_factory, tmp_path):
    """V2's MTP speculator (a tiny MiMo target's own MTP layer,
    tests/vllm/tiny_models.py) under our manager, estimator and adaptive
    depth, forced through 0, 1, K, 2 with CUDA graphs; the reference is the
    MiMo target's own exact distribution."""
    from tiny_models import build_mtp_target, first_tokens_distribution

    mimo = build_mtp_target(tmp_path_factory.mktemp("mimo"))
    exact_mimo = first_tokens_distribution(mimo.target, PROMPT, NUM_TOKENS).numpy()
    pvals, stats = _sample_on_v2(mimo, exact_mimo, cost_table, tmp_path,
                                 "MRV2 with MTP, depths 0,1,K,2", {}, method="mtp",
                                 alternate_depth="0,1,K,2")
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["verified"] > 0 and stats["zero_depth_steps"] > 0, stats


def test_dspark_with_its_confidence_head_on_model_runner_v2_matches_target_distribution(
        models, exact, cost_table, tmp_path):
    """V2's DSpark speculator with a (random) trained confidence head: the
    head's confidences size and select what is verified (no estimator is
    built), with CUDA graphs. Block drafting: no depth."""
    from tiny_models import build_dspark_draft

    pvals, stats = _sample_on_v2(build_dspark_draft(models), exact, cost_table, tmp_path,
                                 "MRV2 with DSpark and its head", {}, method="dspark")
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["confidence_source"] == "head", stats
    assert stats["trimmed"] > 0 and stats["depth_steps"] == 0, stats


def test_dflash_on_model_runner_v2_matches_target_distribution(
        models, exact, cost_table, tmp_path):
    """V2's DFlash speculator (a random tiny Qwen3 head over the target's
    aux hidden states, all K drafts in one non-causal pass) under our
    manager, with CUDA graphs: scored by our estimator, budgeted and
    trimmed. Block drafting: no depth."""
    from tiny_models import build_dflash_draft

    pvals, stats = _sample_on_v2(build_dflash_draft(models), exact, cost_table, tmp_path,
                                 "MRV2 with DFlash", {}, method="dflash")
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["confidence_source"] == "estimator", stats
    assert stats["verified"] > 0 and stats["trimmed"] > 0 and stats["depth_steps"] == 0, stats


# Depth forced to alternate 0, K on Model Runner V2 with depth 0 skipping
# the drafter: over holes in its KV cache (the served default), with the
# drafter's catch-up (option drafter_catch_up: its first forward widened by
# the positions depth-0 steps skipped), and the catch-up with the drafter
# eager (our drafter graphs off); and with depth 0 running the drafter's
# first forward (option zero_depth_skips_drafter off: no holes). In the
# nineteenth round every form run failed (token 2 p = 8e-30 over holes) until
# depth-0 steps replaying a varlen graph were built at its bound
# (MRV2ReplayBoundPatch); with it, holes and catch-up passed, and in the
# twentieth keep_kv and the catch-up with an eager drafter. The two tests
# after this one tell the parts apart. A 20-token prompt (LONG_PROMPT): a window
# reaches back at most to the scheduler's count less the latest steps'
# drafts (up to 2K), so after the
# 4-token prompt few positions are caught up. The uniform forms (option
# uniform_decode_graphs, the default since they passed here in the
# twenty-first round) replay depth-0 steps in one-token FULL graphs; the
# others pin the varlen graph, as they ran before it was the default.
VARLEN = {"VLLM_AV_UNIFORM_DECODE_GRAPHS": "0"}
SKIPPED_DRAFTER_VARIANTS = {
    "holes": {**VARLEN},
    "catch_up": {**VARLEN, "VLLM_AV_DRAFTER_CATCH_UP": "1"},
    "catch_up_eager_drafter": {**VARLEN, "VLLM_AV_DRAFTER_CATCH_UP": "1",
                               "VLLM_AV_DRAFTER_GRAPHS": "0"},
    "keep_kv": {**VARLEN, "VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "0"},
    "uniform_graphs_holes": {"VLLM_AV_UNIFORM_DECODE_GRAPHS": "1"},
    "uniform_graphs_catch_up": {"VLLM_AV_UNIFORM_DECODE_GRAPHS": "1",
                                "VLLM_AV_DRAFTER_CATCH_UP": "1"},
}


@pytest.fixture(scope="module")
def exact_long(models):
    from tiny_models import first_tokens_distribution

    return first_tokens_distribution(models.target, LONG_PROMPT, NUM_TOKENS).numpy()


@pytest.mark.parametrize("variant", list(SKIPPED_DRAFTER_VARIANTS))
def test_our_av_on_model_runner_v2_with_skipped_drafter_matches_target_distribution(
        models, exact_long, cost_table, tmp_path, variant):
    """Same statistic, sample size and threshold as the V2 test above."""
    pvals, stats = _sample_on_v2(models, exact_long, cost_table, tmp_path,
                                 f"MRV2, depth 0/K alternating, {variant}",
                                 SKIPPED_DRAFTER_VARIANTS[variant], alternate_depth=True,
                                 prompt=LONG_PROMPT)
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["verified"] > 0 and stats["zero_depth_steps"] > 0, stats
    if "VLLM_AV_DRAFTER_CATCH_UP" in SKIPPED_DRAFTER_VARIANTS[variant]:
        assert stats.get("catch_up_tokens", 0) > 0, stats


def test_our_av_on_model_runner_v2_with_skipped_drafter_untrimmed_matches_target_distribution(
        models, exact_long, flat_cost_table, tmp_path):
    """Depth 0/K alternating over holes, every draft verified: depth-0
    steps without trimming."""
    pvals, stats = _sample_on_v2(models, exact_long, flat_cost_table, tmp_path,
                                 "MRV2, depth 0/K alternating, holes, untrimmed", {},
                                 alternate_depth=True, prompt=LONG_PROMPT)
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["zero_depth_steps"] > 0 and stats["trimmed"] == 0, stats


def test_our_av_on_model_runner_v2_with_plain_depth_zero_steps_matches_target_distribution(
        models, exact_long, cost_table, tmp_path):
    """Depths K, 0, 0 in turn over holes, as served (uniform graphs), under
    trimming: a step after a depth-0 step verifies no draft, and at depth 0
    drafts none, so it ends as plain decoding (vllm_av/vllm/mrv2/plain_step.py,
    option plain_zero_draft_steps); the depth-K drafts are verified (trimmed)
    the step after. Three tokens per sample: the cycle drafts before the
    plain step, so that drafts land within each sample's tokens."""
    pvals, stats = _sample_on_v2(models, exact_long, cost_table, tmp_path,
                                 "MRV2, depths K/0/0, plain depth-0 steps", {},
                                 alternate_depth="K,0,0", prompt=LONG_PROMPT)
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["plain_steps"] > 0 and stats["verified"] > 0, stats


@pytest.fixture(scope="module")
def models_draft_head64(models):
    from tiny_models import build_draft_with_head_size

    return build_draft_with_head_size(models, 64)


def test_our_av_on_model_runner_v2_skipping_draft_layer_metadata_matches_target_distribution(
        models_draft_head64, exact_long, cost_table, tmp_path):
    """Option skip_draft_layer_metadata (vllm_av/vllm/mrv2/draft_metadata.py)
    with a draft whose heads differ from the target's (one of 64 against
    two of 32), so that its layers form attention groups of their own, as
    the real pair's do: target steps build their metadata without them.
    Depths K, 0, 0 in turn under trimming, so that such builds serve steps
    that verify drafts, steps that draft, and plain steps. Same statistic,
    sample size and threshold as above."""
    pvals, stats = _sample_on_v2(models_draft_head64, exact_long, cost_table, tmp_path,
                                 "MRV2, draft layers' metadata skipped, depths K/0/0",
                                 {"VLLM_AV_SKIP_DRAFT_LAYER_METADATA": "1"},
                                 alternate_depth="K,0,0", prompt=LONG_PROMPT)
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["draft_metadata_skips"] > 0, stats
    assert stats["plain_steps"] > 0 and stats["verified"] > 0, stats


def test_our_av_on_model_runner_v2_at_depth_k_trimmed_matches_target_distribution(
        models, exact_long, cost_table, tmp_path):
    """Every step drafts K (no depth-0 step) and the budget trims: the
    device's admission and varlen verify layout without depth 0."""
    pvals, stats = _sample_on_v2(models, exact_long, cost_table, tmp_path,
                                 "MRV2, depth K, trimmed", {"VLLM_AV_TEST_FIXED_DEPTH": str(K)},
                                 prompt=LONG_PROMPT)
    assert min(pvals.values()) >= ALPHA, pvals
    assert stats is not None and stats["zero_depth_steps"] == 0 and stats["trimmed"] > 0, stats


def test_negative_control_token_dependent_admission_is_detected_on_gpu(
    models, exact, cost_table, tmp_path
):
    tokens = sample(models, cost_table, tmp_path / "metrics", lossy=True, dtype="bfloat16")
    pvals = p_values(tokens, exact)
    print(f"GPU lossy admission (bfloat16): chi-square p-values {pvals}")
    assert min(pvals["token2"], pvals["joint12"]) < ALPHA, pvals
