"""/metrics when a drafter's trained confidence head scores the drafts
(V2's DSpark with its head: vLLM builds no estimator): the estimator's
series and the verdict counts it keeps are left out rather than shown as
zeros, and a gauge says which source scored."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("prometheus_client")

from vllm_av.vllm.metrics import SNAPSHOT_NAME, AVCollector  # noqa: E402


def _families(tmp_path, source: str) -> dict:
    snap = {"steps": 3, "drafted": 12, "verified": 0, "admitted": 8, "accepted": 0,
            "trimmed": 4, "budget": 2, "depth": 4, "depth_steps": 0, "zero_depth_steps": 0,
            "depth_counts": [], "confidence_source": source, "slope": 0.0,
            "intercepts": [0.0] * 4, "predicted": [0.0] * 4, "observed": [0.0] * 4,
            "labelled": [0.0] * 4}
    (tmp_path / SNAPSHOT_NAME.format(rank=0)).write_text(json.dumps(snap))
    return {f.name: f for f in AVCollector(str(tmp_path)).collect()}


def test_a_head_scored_engine_shows_no_estimator_series(tmp_path):
    head = _families(tmp_path, "head")
    assert head["vllm_av:confidence_from_head"].samples[0].value == 1
    for absent in ("vllm_av:estimator_slope", "vllm_av:estimator_intercept",
                   "vllm_av:acceptance_predicted", "vllm_av:draft_tokens_accepted",
                   "vllm_av:draft_tokens_verified"):
        assert absent not in head
    assert "vllm_av:draft_tokens_admitted" in head and "vllm_av:budget" in head
    # Control: the same snapshot from our estimator shows them all.
    est = _families(tmp_path, "estimator")
    assert est["vllm_av:confidence_from_head"].samples[0].value == 0
    for present in ("vllm_av:estimator_slope", "vllm_av:draft_tokens_accepted",
                    "vllm_av:draft_tokens_verified"):
        assert present in est
