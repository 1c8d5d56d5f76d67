"""Corrections of the cost tables that are never re-measured expire.

A correction is measured only where the policy steps. One taken while the
machine was loaded, at a size the policy then avoids because of that very
correction, would otherwise price that size for the rest of the run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_av.core.cost_model import CostModel
from vllm_av.core.verifier import CALIBRATION_STALE_STEPS, AdaptiveVerifier

K = 3
R = 4
# True costs (ms): a plain step of R tokens, verification of R * (1 + d)
# tokens, and drafting at depth d. At full acceptance depth 1 pays (2
# tokens per request in 140 ms against 1 in 100) and depth K does not
# (4 in 450), so explorations at depth K never time depth 1's sizes.
PLAIN_MS = 100.0
VERIFY_MS = {1: 110.0, 2: 200.0, 3: 300.0}
DRAFT_MS = {1: 30.0, 2: 90.0, 3: 150.0}
CONTENDED = 5.0  # the slow-down while another process shares the machine


def _verifier() -> AdaptiveVerifier:
    cost = CostModel.from_samples(
        {R: [PLAIN_MS], R * 2: [VERIFY_MS[1]], R * 3: [VERIFY_MS[2]], R * 4: [VERIFY_MS[3]]},
        {R: [DRAFT_MS[K]]},
        draft_by_depth={1: {R: [DRAFT_MS[1]]}, K: {R: [DRAFT_MS[K]]}},
    )
    return AdaptiveVerifier(K, cost)


def _step(v: AdaptiveVerifier, ids: list[str]) -> int:
    """One step: choose a depth, draft, verify (every draft accepted) and
    time it at the true costs."""
    d = v.choose_depth(ids, num_sampling=R, num_other_tokens=R)
    if d:
        admitted = v.admit(ids, torch.full((R, K), 3.0), np.full(R, d), R, R)
        v.begin_step()
        v.observe(ids, admitted, admitted)
        v.observe_draft_time(d, R, DRAFT_MS[d])
        v.observe_verify_time(int(R + admitted.sum()), VERIFY_MS.get(int(admitted.max()), PLAIN_MS))
    else:
        v.observe_verify_time(R, PLAIN_MS, plain=True)
    return d


@pytest.fixture(autouse=True)
def explore_every_eight_steps(monkeypatch):
    """Exploration paced by the step-count rule alone, as where full depth
    is cheap: every 8 steps at 4 requests."""
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_MAX_TIME_SHARE", float("inf"))
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_HOPELESS_TIME_SHARE", float("inf"))
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_BACKOFF_MAX", 1)


def _run_after_contended_start(steps: int) -> list[int]:
    """Three steps at depth 1 timed under contention, three plain ones not, then `steps` steps
    timed at the true costs; the depths chosen in those."""
    v = _verifier()
    ids = [f"r{i}" for i in range(R)]
    for _ in range(3):  # timed, not chosen: the engine's first steps
        v.observe_draft_time(1, R, CONTENDED * DRAFT_MS[1])
        v.observe_verify_time(2 * R, CONTENDED * VERIFY_MS[1])
    for _ in range(3):  # timed after the other process stopped
        v.observe_verify_time(R, PLAIN_MS, plain=True)
    return [_step(v, ids) for _ in range(steps)]


def test_a_contended_correction_never_re_measured_expires():
    depths = _run_after_contended_start(4 * CALIBRATION_STALE_STEPS)
    early, late = depths[:CALIBRATION_STALE_STEPS], depths[-CALIBRATION_STALE_STEPS:]
    # While the contended corrections stand the policy never drafts at
    # depth 1, the best depth: steps at other depths re-time other keys ...
    assert early.count(1) == 0
    # ... and once they expire depth 1 is the usual choice.
    assert late.count(1) > 0.8 * len(late)


def test_negative_control_without_expiry_the_policy_stays_away(monkeypatch):
    monkeypatch.setattr("vllm_av.core.verifier.CALIBRATION_STALE_STEPS", 10**9)
    depths = _run_after_contended_start(4 * CALIBRATION_STALE_STEPS)
    assert depths.count(1) == 0


def test_a_table_never_loses_its_last_correction():
    v = _verifier()
    for _ in range(3):
        v.observe_verify_time(R * 2, 2 * VERIFY_MS[1])
    assert v.cost.verify_scale == {3: pytest.approx(2.0)}
    for _ in range(4 * CALIBRATION_STALE_STEPS):
        v.observe_verify_time(R, PLAIN_MS, plain=True)
    # Stale, but the only one the table has: it stands.
    assert v.cost.verify_scale == {3: pytest.approx(2.0)}
    # The plain table's one bucket, timed on every step, stands too.
    assert v.cost.plain_verify_scale == {2: pytest.approx(1.0)}
