"""Our AV on the GPU (Model Runner V1), with the real Qwen2.5-Coder pair;
greedy agreement of the sweep's other speculative arms too.

Skipped without CUDA, vLLM or the bf16 models (TARGET_MODEL / DRAFT_MODEL,
as the GPU kit's env.sh sets them). Run by scripts/gpu/round.sh.

Greedy agreement: speculative and plain decoding run different batch
shapes, and bf16 kernels are not batch-invariant, so two correct engines
may flip a near-tied argmax and diverge from there. The test therefore
requires every output to agree with no speculation on a long common prefix
and most outputs to match exactly, and prints the exact-match count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")
TARGET = os.environ.get("TARGET_MODEL", "")
DRAFT = os.environ.get("DRAFT_MODEL", "")
if not (os.path.isdir(TARGET) and os.path.isdir(DRAFT)):
    pytest.skip("needs TARGET_MODEL and DRAFT_MODEL (bf16 folders)", allow_module_level=True)

K = 7
MAX_TOKENS = 48
# A bf16 argmax flip can end exact agreement early, but not before this
# fraction of the output on average.
MIN_MEAN_PREFIX_FRACTION = 0.8

RUN_ENGINE = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    cfg = json.loads(sys.argv[1])
    if cfg.get("alternate_depth"):
        # Depth 0, K, 0, K, ...: every draft follows a step that skipped the
        # drafter. Needs the engine core in this process
        # (VLLM_ENABLE_V1_MULTIPROCESSING=0).
        import itertools
        from vllm_av.core.verifier import AdaptiveVerifier
        step = itertools.count()
        AdaptiveVerifier.choose_depth = (
            lambda self, *a, **kw: 0 if next(step) % 2 == 0 else self.K)
    if cfg.get("fixed_depth") is not None:
        # Every step at this depth (in-process engine core, as above).
        from vllm_av.core.verifier import AdaptiveVerifier
        AdaptiveVerifier.choose_depth = lambda self, *a, **kw: cfg["fixed_depth"]
    replays = {"uniform_1_graph_replays": 0, "uniform_2_graph_replays": 0,
               "other_full_graph_replays": 0}
    if cfg.get("probe_uniform_graphs"):
        # Which FULL graphs the target's steps replay (in-process engine).
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
        _run_full = CudaGraphManager.run_fullgraph
        def run_fullgraph(self, desc, *a, **kw):
            u = desc.uniform_token_count
            key = (f"uniform_{u}_graph_replays" if u in (1, 2) and desc.max_query_len == u
                   else "other_full_graph_replays")
            replays[key] += 1
            return _run_full(self, desc, *a, **kw)
        CudaGraphManager.run_fullgraph = run_fullgraph
    llm = LLM(model=cfg["target"], dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=0.3, enforce_eager=cfg["eager"], seed=0,
              max_num_seqs=256, disable_log_stats=False,
              speculative_config=cfg["spec"], **cfg["extra"])
    prompts = [
        "def fibonacci(n):", "def is_prime(n):", "class Stack:",
        "def quicksort(xs):", "def binary_search(a, x):", "import numpy as np\\ndef softmax(x):",
        "def merge(a, b):", "def gcd(a, b):",
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    counts = {m.name.split("spec_decode_")[1]: m.value for m in llm.get_metrics()
              if m.name in ("vllm:spec_decode_num_draft_tokens",
                            "vllm:spec_decode_num_accepted_tokens")}
    if cfg.get("alternate_depth"):
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker \\
            .worker.model_runner
        # V1 keeps its catch-up on the runner, V2 on the speculator.
        catch_up = (getattr(runner, "_vllm_av_catch_up", None)
                    or getattr(getattr(runner, "speculator", None), "_vllm_av_catch_up", None))
        counts["catch_up_tokens"] = catch_up.tokens_total if catch_up else 0
    if cfg.get("probe_drafter_graphs"):
        # How many draft forwards replayed our graphs (in-process engine).
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker \\
            .worker.model_runner
        graphs = getattr(runner.speculator, "_vllm_av_graphs", None)
        counts["drafter_graph_replays"] = graphs.replays if graphs else 0
    if cfg.get("probe_uniform_graphs"):
        counts.update(replays)
    print("COUNTS " + json.dumps(counts))
    print("RESULT " + json.dumps(outs))
    """
)


def run_engine(spec, eager: bool, env_extra: dict, counts: dict | None = None,
               llm_args: dict | None = None, alternate_depth: bool = False,
               probe_drafter_graphs: bool = False,
               probe_uniform_graphs: bool = False,
               fixed_depth: int | None = None) -> list[list[int]]:
    env = dict(os.environ, **env_extra)
    if alternate_depth or probe_drafter_graphs or probe_uniform_graphs or fixed_depth is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cfg = {"target": TARGET, "spec": spec, "eager": eager, "max_tokens": MAX_TOKENS,
           "extra": llm_args or {}, "alternate_depth": alternate_depth,
           "probe_drafter_graphs": probe_drafter_graphs,
           "probe_uniform_graphs": probe_uniform_graphs, "fixed_depth": fixed_depth}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_ENGINE, json.dumps(cfg)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    if counts is not None:
        for l in proc.stdout.splitlines():
            if l.startswith("COUNTS "):
                counts.update(json.loads(l[len("COUNTS "):]))
    return json.loads(lines[-1][len("RESULT "):])


def acceptance(counts: dict) -> float:
    """Accepted share of the drafts an engine verified (its spec counters)."""
    return counts["num_accepted_tokens"] / counts["num_draft_tokens"]


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def assert_agrees(outs, plain, label: str, counts: dict | None = None) -> None:
    """Every output agrees with no speculation on a long common prefix and
    most match exactly (see the module docstring); prints the counts."""
    prefix = [common_prefix(a, b) / MAX_TOKENS for a, b in zip(outs, plain)]
    exact = sum(a == b for a, b in zip(outs, plain))
    print(f"{label}: exact matches {exact}/{len(outs)}; mean common prefix "
          f"{sum(prefix)/len(prefix):.2f}" + (f"; spec counts {counts}" if counts is not None else ""))
    assert sum(prefix) / len(prefix) >= MIN_MEAN_PREFIX_FRACTION
    assert exact >= len(outs) // 2


@pytest.fixture(scope="module")
def plain_outputs():
    return run_engine(None, eager=True, env_extra={})


def test_our_av_starts_eager_on_the_v1_runner_and_keeps_greedy_outputs(plain_outputs):
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
    ours = run_engine(spec, eager=True, env_extra={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert_agrees(ours, plain_outputs, "eager")


def test_our_av_with_enforce_eager_and_no_runner_named_is_served_on_v1(plain_outputs, tmp_path,
                                                                      monkeypatch):
    """`--enforce-eager` with nothing else set: vLLM's default runner on a
    GPU is V2, which refuses AV without FULL graphs; the flag is served on
    V1 eagerly instead (`prefer_v1_when_eager`), outputs agree, and our
    manager sized the steps (its snapshot exists only where it ran)."""
    from vllm_av.vllm.metrics import read_snapshot

    for name in ("VLLM_AV_MRV2", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_AV_IMPL",
                 "VLLM_AV_DRAFTER_GRAPHS"):
        monkeypatch.delenv(name, raising=False)
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
    counts: dict = {}
    outs = run_engine(spec, eager=True, counts=counts,
                      env_extra={"VLLM_AV_METRICS_DIR": str(tmp_path), "VLLM_AV_METRICS_INTERVAL": "1"})
    assert_agrees(outs, plain_outputs, "ours eager, no runner named", counts)
    stats = read_snapshot(str(tmp_path))
    assert stats is not None and stats["steps"] > 0, stats


def test_vllm_builtin_av_refuses_eager_mode_where_ours_starts():
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
    with pytest.raises(RuntimeError, match="CUDA graphs|cudagraph"):
        run_engine(spec, eager=True, env_extra={"VLLM_AV_IMPL": "vllm"})


@pytest.mark.parametrize("adaptive_depth,async_scheduling,option", [
    ("1", False, None), ("0", False, None), ("1", True, None), ("1", True, "ASYNC_PLAIN_STEPS=0"),
    ("0", False, "SKIP_DRAFT_LAYER_METADATA_V1=1"), ("1", True, "SKIP_DRAFT_LAYER_METADATA_V1=1")],
    ids=["synchronous", "always_drafts", "async", "async_copying", "always_drafts_skipmeta",
         "async_skipmeta"])
def test_our_av_with_cuda_graphs_keeps_greedy_outputs(plain_outputs, adaptive_depth,
                                                     async_scheduling, option):
    """Default compilation and CUDA graphs, so the varlen steps our
    admission produces run through vLLM's graphs (and ours:
    FULL graphs for any draft length, vllm_av/vllm/mrv1/graphs.py). With
    adaptive depth off every step drafts K and the budget trims, so trimmed
    steps are verified for certain; drafted and accepted counts must be > 0
    there (an engine that never verified a draft would pass the output check
    trivially). With async scheduling (the default on one GPU; `async`) the
    depth is chosen when each step is scheduled (vllm_av/vllm/mrv1/scheduled_depth.py) and depth-0 steps skip
    the drafter; `async_copying` has those steps copy their sampled-token
    counts for vLLM's correction (async_plain_steps off). `*_skipmeta`: the
    target's attention metadata built without the draft's layers
    (skip_draft_layer_metadata_v1; the real pair's head sizes differ), with
    the drafter running every step and as served."""
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
    counts: dict = {}
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_AV_ADAPTIVE_DEPTH": adaptive_depth}
    if option:
        name, value = option.split("=")
        env[f"VLLM_AV_{name}"] = value
    ours = run_engine(spec, eager=False, counts=counts, env_extra=env,
                      llm_args={"async_scheduling": async_scheduling})
    assert_agrees(ours, plain_outputs,
                  f"graphs (adaptive depth {adaptive_depth}, async {async_scheduling}, "
                  f"{option or 'defaults'})", counts)
    if adaptive_depth == "0":
        assert counts.get("num_draft_tokens", 0) > 0
        assert counts.get("num_accepted_tokens", 0) > 0


@pytest.fixture(scope="module")
def alternating_drafts(plain_outputs):
    """Ours as served (async scheduling) with the depth forced to alternate
    0, K, 0, K, ...: every draft follows a step that skipped the drafter.
    Without the catch-up the drafter drafts over holes in its KV cache;
    with it (drafter_catch_up) it first writes them."""
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
    runs = {}
    for name, on in (("holes", "0"), ("caught_up", "1")):
        counts: dict = {}
        outs = run_engine(spec, eager=False, counts=counts, alternate_depth=True,
                          env_extra={"VLLM_USE_V2_MODEL_RUNNER": "0",
                                     "VLLM_AV_DRAFTER_CATCH_UP": on},
                          llm_args={"async_scheduling": True})
        assert_agrees(outs, plain_outputs, f"alternating depth, catch-up {on}", counts)
        runs[name] = counts
    return runs


def test_caught_up_drafts_are_accepted_more_than_drafts_over_holes(alternating_drafts):
    """The drafter catch-up on the GPU with the real pair: greedy outputs
    agree with no speculation either way (checked in the fixture); the
    catch-up ran; and the drafts it made possible are accepted more often
    than the same engine's drafts over holes (the control)."""
    holes, caught_up = alternating_drafts["holes"], alternating_drafts["caught_up"]

    print(f"acceptance over holes {acceptance(holes):.2f}, caught up "
          f"{acceptance(caught_up):.2f} ({caught_up['catch_up_tokens']} positions)")
    assert holes["catch_up_tokens"] == 0 < caught_up["catch_up_tokens"]
    assert acceptance(caught_up) > acceptance(holes) + 0.1


@pytest.mark.parametrize("arm", ["vllm_av", "fixed_k3"])
def test_other_speculative_arms_keep_greedy_outputs(plain_outputs, arm):
    """vLLM's own AV and fixed K=3, on vLLM's default runner (Model Runner
    V2) with CUDA graphs, against the same no-speculation outputs and with
    the same tolerance: the sweep's other arms decode what the target
    decodes, so their throughputs compare like with like."""
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
    env = {"VLLM_AV_IMPL": "vllm"}
    if arm == "fixed_k3":
        spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3}
        env = {"VLLM_AV_IMPL": "off"}
    counts: dict = {}
    outs = run_engine(spec, eager=False, counts=counts, env_extra=env)
    assert_agrees(outs, plain_outputs, arm, counts)
    assert counts.get("num_draft_tokens", 0) > 0


MRV2_ENV = {"VLLM_AV_IMPL": "ours", "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_AV_MRV2": "1",
            "VLLM_AV_METRICS_INTERVAL": "1"}


def _run_mrv2(plain_outputs, tmp_path, label, env=None, alternate_depth=False, spec=None,
              probe_uniform_graphs=False, fixed_depth=None):
    from vllm_av.vllm.metrics import read_snapshot

    spec = spec or {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
                    "enable_adaptive_verification": True}
    counts: dict = {}
    outs = run_engine(spec, eager=False, counts=counts, alternate_depth=alternate_depth,
                      probe_uniform_graphs=probe_uniform_graphs, fixed_depth=fixed_depth,
                      env_extra={**MRV2_ENV, "VLLM_AV_METRICS_DIR": str(tmp_path), **(env or {})})
    assert_agrees(outs, plain_outputs, label, counts)
    stats = read_snapshot(str(tmp_path))
    print(f"{label}: AV counters {stats}")
    assert stats is not None, "our manager wrote no metrics"
    return counts, stats


def test_our_av_on_model_runner_v2_keeps_greedy_outputs(plain_outputs, tmp_path):
    """Our estimator and manager inside Model Runner V2's AV (the opt-in
    `VLLM_AV_MRV2=1` path: vllm_av/vllm/mrv2/), CUDA graphs, full drafting
    depth (VLLM_AV_ADAPTIVE_DEPTH=0), against the same no-speculation
    outputs and tolerance, with the draft model; drafts were verified (an
    engine that never verified one would pass the output check trivially)
    and our manager sized the steps (its metrics snapshot: an engine that
    served the flag without it would pass both checks, as ngram on V2 did
    before it was refused)."""
    counts, stats = _run_mrv2(plain_outputs, tmp_path, "ours on MRV2, depth K",
                              env={"VLLM_AV_ADAPTIVE_DEPTH": "0"})
    assert counts.get("num_draft_tokens", 0) > 0
    assert stats["steps"] > 0 and stats["drafted"] > 0 and stats["depth_steps"] == 0, stats


NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2, "enable_adaptive_verification": True}


def test_our_av_is_served_inside_model_runner_v2_by_default(plain_outputs, tmp_path,
                                                           monkeypatch):
    """No runner or path chosen (vLLM's default runner, V2 on a GPU, and
    none of our switches set): the flag is served by our manager inside V2,
    outputs agree and drafts were verified (our metrics snapshot exists
    only where our manager ran), scored by our estimator: the draft model
    has no head, and with CUDA graphs vLLM builds a throwaway manager first
    that once took the estimator and left the served one scoring as
    "head", with nothing verified."""
    from vllm_av.vllm.metrics import read_snapshot

    for name in ("VLLM_AV_MRV2", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_AV_IMPL",
                 "VLLM_AV_DRAFTER_GRAPHS"):
        monkeypatch.delenv(name, raising=False)
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
    counts: dict = {}
    outs = run_engine(spec, eager=False, counts=counts,
                      env_extra={"VLLM_AV_METRICS_DIR": str(tmp_path), "VLLM_AV_METRICS_INTERVAL": "1",
                                 "VLLM_AV_ADAPTIVE_DEPTH": "0"})
    assert_agrees(outs, plain_outputs, "ours by default (V2)", counts)
    stats = read_snapshot(str(tmp_path))
    assert stats is not None and stats["steps"] > 0 and stats["drafted"] > 0, stats
    assert stats["confidence_source"] == "estimator" and stats["verified"] > 0, stats
    assert counts.get("num_draft_tokens", 0) > 0


def test_our_av_for_ngram_on_model_runner_v2_keeps_greedy_outputs(plain_outputs, tmp_path):
    """ngram on V2 through MRV2NgramAVPatch (vLLM's GPU ngram speculator
    given the AV seam it lacks), depth K: outputs agree with no
    speculation, our manager sized the steps and drafts were verified.
    Before the patch, V2 built no AV manager for ngram at all."""
    counts, stats = _run_mrv2(plain_outputs, tmp_path, "ours on MRV2, ngram", spec=NGRAM_SPEC,
                              env={"VLLM_AV_ADAPTIVE_DEPTH": "0"})
    assert counts.get("num_draft_tokens", 0) > 0
    assert stats["steps"] > 0 and stats["drafted"] > 0 and stats["verified"] > 0, stats


def test_ngram_depth_alternating_on_model_runner_v2_keeps_greedy_outputs(plain_outputs, tmp_path):
    """ngram on V2 with adaptive depth, the depth forced to alternate 0, K:
    at depth 0 the scan is skipped and the step runs plain; outputs agree,
    drafts were verified on the other steps, both kinds were counted."""
    counts, stats = _run_mrv2(plain_outputs, tmp_path, "ours on MRV2, ngram, depth 0/K",
                              spec=NGRAM_SPEC, alternate_depth=True)
    assert counts.get("num_draft_tokens", 0) > 0
    assert stats["depth_steps"] > 0 and 0 < stats["zero_depth_steps"] < stats["depth_steps"], stats


def test_adaptive_depth_on_model_runner_v2_keeps_greedy_outputs(plain_outputs, tmp_path):
    """Adaptive drafting depth on V2 with the depth forced to alternate 0,
    K, 0, K, ... (every kind of step: drafter skipped, drafter run after a
    skip, drafts verified or none): outputs agree, drafts were verified,
    and our policy's depth steps were counted, half of them depth 0."""
    counts, stats = _run_mrv2(plain_outputs, tmp_path, "ours on MRV2, depth 0/K alternating",
                              alternate_depth=True)
    assert counts.get("num_draft_tokens", 0) > 0
    assert stats["depth_steps"] > 0 and 0 < stats["zero_depth_steps"] < stats["depth_steps"], stats


def test_uniform_decode_graphs_on_model_runner_v2_keep_greedy_outputs(plain_outputs, tmp_path):
    """Option uniform_decode_graphs (vllm_av/vllm/mrv2/uniform_graphs.py):
    with depth forced to alternate 0, K, steps that schedule no draft
    replay the one-token FULL graphs and drafting steps the varlen ones;
    then with every step at depth 1, steps with every draft admitted
    replay the two-token graphs. Outputs agree with no speculation both
    times."""
    env = {"VLLM_AV_UNIFORM_DECODE_GRAPHS": "1"}
    counts, stats = _run_mrv2(plain_outputs, tmp_path, "ours on MRV2, uniform graphs, depth 0/K",
                              env=env, alternate_depth=True, probe_uniform_graphs=True)
    assert counts.get("num_draft_tokens", 0) > 0
    assert counts["uniform_1_graph_replays"] > 0 and counts["other_full_graph_replays"] > 0, counts
    assert 0 < stats["zero_depth_steps"] < stats["depth_steps"], stats
    counts, _ = _run_mrv2(plain_outputs, tmp_path / "d1", "ours on MRV2, uniform graphs, depth 1",
                          env=env, fixed_depth=1, probe_uniform_graphs=True)
    assert counts["uniform_2_graph_replays"] > 0, counts


def test_skip_draft_layer_metadata_on_model_runner_v2_keeps_greedy_outputs(plain_outputs,
                                                                          tmp_path):
    """Option skip_draft_layer_metadata on V2 (vllm_av/vllm/mrv2/draft_metadata.py),
    depth K so the drafter runs every step beside target steps that no
    longer build its layers' metadata: outputs agree, and the drafts are as
    good as without the option (a drafter reading stale metadata would
    draft poorly: at depth K without it 338 of 434 were accepted, 0.78,
    sixteenth round)."""
    counts, stats = _run_mrv2(plain_outputs, tmp_path, "ours on MRV2, skip draft metadata",
                              env={"VLLM_AV_SKIP_DRAFT_LAYER_METADATA": "1",
                                   "VLLM_AV_ADAPTIVE_DEPTH": "0"})
    assert counts.get("num_draft_tokens", 0) > 0
    assert acceptance(counts) >= 0.6, counts


@pytest.fixture(scope="module")
def v2_alternating_drafts(plain_outputs, tmp_path_factory):
    """Ours on V2 with the depth forced to alternate 0, K, 0, K, ...: every
    draft follows a step that skipped the drafter, with and without the
    catch-up (option drafter_catch_up, vllm_av/vllm/mrv2/catch_up.py), and
    the reference: depth-0 steps that run the drafter's first forward
    (option zero_depth_skips_drafter off), whose cache has no holes."""
    runs = {}
    for name, env in (("holes", {"VLLM_AV_DRAFTER_CATCH_UP": "0"}),
                      ("caught_up", {"VLLM_AV_DRAFTER_CATCH_UP": "1"}),
                      ("whole", {"VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER": "0"})):
        counts, _ = _run_mrv2(plain_outputs, tmp_path_factory.mktemp(name),
                              f"ours on MRV2, depth 0/K alternating, {name}",
                              env=env, alternate_depth=True)
        runs[name] = counts
    return runs


def test_caught_up_drafts_on_model_runner_v2_are_accepted_more_than_drafts_over_holes(
        v2_alternating_drafts):
    """Outputs agree with no speculation every way (the fixture); the
    catch-up ran the drafter over the skipped positions, and its drafts
    were accepted as often as those of a drafter whose cache has no holes
    (within 0.05) and more often than those drafted over holes (eighteenth
    round: holes 229 of 567 accepted, 0.40; caught up 246 of 518, 0.47)."""
    runs = v2_alternating_drafts
    holes, caught_up, whole = runs["holes"], runs["caught_up"], runs["whole"]
    print(f"acceptance over holes {acceptance(holes):.2f}, caught up "
          f"{acceptance(caught_up):.2f} ({caught_up['catch_up_tokens']} positions), "
          f"no holes {acceptance(whole):.2f}")
    assert holes["catch_up_tokens"] == 0 < caught_up["catch_up_tokens"]
    assert acceptance(caught_up) >= acceptance(whole) - 0.05
    assert acceptance(caught_up) > acceptance(holes)


def test_adaptive_depth_on_model_runner_v2_as_served(plain_outputs, tmp_path):
    """As served (the policy chooses): outputs agree and the depth was
    chosen at every scheduled step with decoding requests."""
    counts, stats = _run_mrv2(plain_outputs, tmp_path, "ours on MRV2, adaptive depth")
    assert stats["depth_steps"] > 0, stats
    print(f"depth 0 on {stats['zero_depth_steps']} of {stats['depth_steps']} steps; "
          f"drafts {counts.get('num_draft_tokens', 0)}, accepted {counts.get('num_accepted_tokens', 0)}")

DRAFTER_GRAPHS_ENV = {"VLLM_AV_IMPL": "ours", "VLLM_USE_V2_MODEL_RUNNER": "1",
                      "VLLM_AV_MRV2": "1"}


@pytest.fixture(scope="module")
def v2_fixed_k_drafters(plain_outputs):
    """Fixed K=3 on Model Runner V2, the draft model run eagerly (vLLM 0.32
    as shipped) and in our FULL graphs (VLLM_AV_DRAFTER_GRAPHS=1), greedy."""
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3}
    runs = {}
    for label, on in (("eager", "0"), ("graphs", "1")):
        counts: dict = {}
        outs = run_engine(spec, eager=False, counts=counts, probe_drafter_graphs=True,
                          env_extra={**DRAFTER_GRAPHS_ENV, "VLLM_AV_DRAFTER_GRAPHS": on})
        assert_agrees(outs, plain_outputs, f"K=3 on V2, drafter {label}", counts)
        runs[label] = counts
    return runs


def test_drafter_graphs_on_model_runner_v2_keep_outputs_and_acceptance(v2_fixed_k_drafters):
    """The drafter's forwards replayed from our graphs (the control, run
    eagerly, replayed none) propose what the eager drafter proposes: greedy
    outputs agree with no speculation either way (the fixture), and the
    graphs' drafts are accepted as often as the eager drafter's, within
    0.05. Drafts computed from wrong inputs or stale attention metadata
    would still decode losslessly, so acceptance is what catches them."""
    eager, graphs = v2_fixed_k_drafters["eager"], v2_fixed_k_drafters["graphs"]

    print(f"acceptance eager {acceptance(eager):.3f}, graphs {acceptance(graphs):.3f}; "
          f"graph replays {graphs['drafter_graph_replays']}")
    assert eager["drafter_graph_replays"] == 0 < graphs["drafter_graph_replays"]
    assert acceptance(graphs) >= acceptance(eager) - 0.05
