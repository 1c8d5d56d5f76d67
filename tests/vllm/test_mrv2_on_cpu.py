"""Our Model Runner V2 path end to end on the CPU (scripts/mrv2_cpu_distribution.py),
with the draft model, an EAGLE head, an MTP layer, a DSpark head (with and
without its trained confidence head) and a DFlash head.

vLLM 0.32's V2 runner with its Triton kernels interpreted, our V2 patches
serving the flag (manager, estimator, adaptive depth with the depth forced
to alternate 0 and K, the drafter's catch-up), a budget that trims every
step. A small sample: this checks that the path runs and does what it
claims (steps of depth 0 and K, drafts trimmed and verified, positions
caught up). The p-values it prints have little power at N = 256 and are
not asserted; the distribution is the GPU test's (tests/gpu/) and the
script's at N >= 1024.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("scipy.stats")

ROOT = Path(__file__).resolve().parents[2]


def run_script(*args: str) -> dict:
    """scripts/mrv2_cpu_distribution.py with `args`: its JSON summary."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mrv2_cpu_distribution.py"), *args],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_our_v2_path_with_catch_up_runs_on_the_cpu_and_keeps_the_distribution():
    result = run_script("--n", "256", "--variant", "catch_up", "--trim")
    stats = result["av_counters"]
    print(result)
    assert stats["zero_depth_steps"] > 0 and stats["depth_steps"] > stats["zero_depth_steps"]
    assert stats["trimmed"] > 0 and stats["verified"] > 0, stats
    assert stats["catch_up_tokens"] > 0, stats


def test_steps_that_verify_and_draft_nothing_end_as_plain_decoding_on_the_cpu():
    """Depths K, 0, 0 in turn (no catch-up): the step after a depth-0 step
    verifies nothing and drafts nothing, so it runs vLLM's sample_tokens
    with the speculator hidden (vllm_av/vllm/mrv2/plain_step.py); the
    depth-K drafts around it are still verified and trimmed."""
    result = run_script("--n", "256", "--variant", "holes", "--trim", "--depth-cycle", "K,0,0")
    stats = result["av_counters"]
    print(result)
    assert result["plain_steps"] > 0, result
    # Admitted and trimmed are counted when a step is budgeted; verified
    # reaches the snapshot a budgeted step later.
    assert stats["zero_depth_steps"] > 0 and stats["admitted"] > 0 and stats["trimmed"] > 0, stats


def test_our_v2_path_serves_an_eagle_drafter_at_every_depth_on_the_cpu():
    """vLLM's V2 EAGLE speculator (a random tiny EAGLE head over the
    target's hidden states) under our V2 manager and estimator, its depth
    scheduled by our adaptive depth (vllm_av/vllm/mrv2/target_drafter.py)
    and forced through 0, 1, K, 2: every one of those depths is run, and
    the drafts are sized by our budget (trimmed) and verified."""
    result = run_script("--n", "256", "--method", "eagle", "--trim", "--depth-cycle", "0,1,K,2")
    stats = result["av_counters"]
    print(result)
    assert result["method"] == "eagle"
    assert stats["trimmed"] > 0 and stats["verified"] > 0, stats
    counts = stats["depth_counts"]
    assert counts[0] > 0 and counts[1] > 0 and counts[2] > 0 and counts[-1] > 0, stats


def test_our_v2_path_serves_an_mtp_drafter_at_every_depth_on_the_cpu():
    """vLLM's V2 MTP speculator (a tiny MiMo target's own MTP layer, reused
    for the K steps) under our manager and estimator, its depth scheduled
    by our adaptive depth and forced through 0, 1, K, 2."""
    result = run_script("--n", "256", "--method", "mtp", "--trim", "--depth-cycle", "0,1,K,2")
    stats = result["av_counters"]
    print(result)
    assert result["speculator"]["speculator"] == "MTPSpeculator", result["speculator"]
    assert result["speculator"]["estimator"] == "AcceptanceEstimator"
    assert result["speculator"]["manager_has_drafters_estimator"], result["speculator"]
    assert stats["trimmed"] > 0 and stats["verified"] > 0 and stats["accepted"] > 0, stats
    counts = stats["depth_counts"]
    assert counts[0] > 0 and counts[1] > 0 and counts[2] > 0 and counts[-1] > 0, stats


def test_a_dspark_drafters_trained_confidence_head_scores_its_drafts_on_the_cpu():
    """vLLM's V2 DSpark speculator with a (random) trained confidence head:
    the head's confidences reach our manager, which budgets and trims with
    them (no estimator is built), and budgets a request not yet recorded at
    the head's mean confidence per position, not at 1. Block drafting: no
    depth is chosen. Control: the same head without its confidence head is
    scored by our estimator."""
    result = run_script("--n", "128", "--method", "dspark", "--trim")
    print(result)
    served, stats = result["speculator"], result["av_counters"]
    assert served["speculator"] == "DSparkSpeculator" and served["confidence_head"], served
    assert served["estimator"] == "NoneType", served
    assert served["manager_has_drafters_estimator"], served  # none for none
    assert all(0.0 < c < 1.0 for c in served["landed_prior_row"]), served
    assert stats["confidence_source"] == "head", stats
    assert stats["trimmed"] > 0 and stats["admitted"] > 0 and stats["depth_steps"] == 0, stats
    control = run_script("--n", "128", "--method", "dspark", "--trim", "--no-confidence-head")
    print(control)
    assert not control["speculator"]["confidence_head"], control["speculator"]
    assert control["speculator"]["estimator"] == "AcceptanceEstimator"
    assert control["speculator"]["manager_has_drafters_estimator"], control["speculator"]
    assert control["av_counters"]["confidence_source"] == "estimator"
    assert control["av_counters"]["verified"] > 0


def test_our_v2_path_serves_a_dflash_drafter_on_the_cpu():
    """vLLM's V2 DFlash speculator (a random tiny Qwen3 head over the
    target's aux hidden states, all K drafts in one non-causal pass):
    scored by our estimator, budgeted and trimmed, no depth chosen."""
    result = run_script("--n", "128", "--method", "dflash", "--trim")
    print(result)
    stats = result["av_counters"]
    assert result["speculator"]["speculator"] == "DFlashSpeculator", result["speculator"]
    assert stats["trimmed"] > 0 and stats["verified"] > 0 and stats["depth_steps"] == 0, stats


def test_the_served_kernel_warm_up_runs_through_our_v2_path_and_leaves_nothing_behind():
    """Our served-kernel warm-up (vllm_av/vllm/mrv2/served_warmup.py), which a
    CUDA worker runs before its JIT monitor starts, run in the CPU worker
    after start-up: vLLM's warm-up steps through our manager (AV on), the
    mixed steps, then serving from a cleared state."""
    result = run_script("--n", "128", "--variant", "holes", "--trim", "--served-warmup")
    warm = result["served_warmup"]
    print(warm)
    assert warm["ran"] is True
    # It ran engine steps, and our manager budgeted some of them (AV on).
    assert warm["execute_calls"] >= 20 and warm["budgeted_before_clearing"] > 0, warm
    # Nothing left: no dummy request, no step counted, no record landed.
    assert warm["dummy_requests_left"] == [] and warm["manager_steps"] == 0, warm
    assert warm["landed_records"] == [-1, -1], warm
    assert result["n"] == 128


def test_with_one_request_slot_the_warm_up_drafts_over_each_longest_query():
    """With max_num_seqs 1 vLLM's mixed warm-up step cannot run (it needs
    two request slots), so the drafter's first forward met no query longer
    than vLLM's own warm-up steps' (6 tokens) before serving: then the
    first long one came while serving. One request's prompt per size
    instead: the drafter runs over the mixed step's longest query of each
    size the tiny vocabulary allows (5, 13, 29, 61 tokens; the code before
    drafted over [6, 5, 1, 6, 5, 1] alone), and serving starts clean."""
    result = run_script("--n", "4", "--variant", "holes", "--trim", "--served-warmup",
                        "--max-num-seqs", "1")
    warm = result["served_warmup"]
    print(warm)
    assert warm["ran"] is True
    assert warm["drafted_queries"][-4:] == [5, 13, 29, 61], warm
    assert warm["dummy_requests_left"] == [] and warm["manager_steps"] == 0, warm
    assert warm["landed_records"] == [-1, -1], warm
    assert result["n"] == 4
