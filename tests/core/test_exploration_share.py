"""benchmarks/exploration_share.py: the drafter's share of ours' served
step time, read from side-by-side JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from exploration_share import (  # noqa: E402
    depth0_step_cost,
    exploration_share,
    exploring_gpu_span,
    first_batch_excess,
)


def _run(ms_per_step: float, propose_ms: float | None) -> dict:
    phases = {"schedule": {"calls": 100, "ms_per_step": 0.1}}
    if propose_ms is not None:
        phases["propose"] = {"calls": 2, "ms_per_step": propose_ms}
    return {"ms_per_step": ms_per_step, "phases": phases}


def test_shares_count_only_ours_and_exploring_batches(tmp_path):
    data = {"by_concurrency": {
        "16": {"runs": {"ours_served": [_run(2.0, 0.02), _run(2.0, None)],
                        "ours_served_twin": [_run(4.0, None)],
                        "nospec": [_run(1.0, 0.5)]}},
        "1": {"runs": {"ours_served": [_run(1.0, None)]}}}}
    path = tmp_path / "side_by_side.json"
    path.write_text(json.dumps(data))
    out = exploration_share([path], "ours_served")
    assert list(out) == ["1", "16"]
    assert out["16"]["batches"] == 3 and out["16"]["exploring_batches"] == 1
    assert out["16"]["mean_share"] == pytest.approx(0.01 / 3)
    assert out["16"]["max_share"] == pytest.approx(0.01)
    assert out["1"]["exploring_batches"] == 0 and out["1"]["mean_share"] == 0.0


def _spanned(span_ms: float, explores: bool, steps: int = 100) -> dict:
    run = _run(2.0, 0.02 if explores else None)
    run["phases"]["gpu_span"] = {"calls": steps, "ms_per_step": span_ms}
    run["steps"] = steps
    return run


def test_exploring_batches_gpu_span_is_read_per_engine(tmp_path):
    """An engine's batches with exploring steps against its batches without:
    the extra GPU time per exploring batch. Engines are kept apart (the
    twin's slower batches do not enter ours'), and an engine with no batch
    of one kind gives no row. Negative control: pooling the twin's batches
    into ours' engine would read 0.5 ms more per step, not 0.1."""
    data = {"by_concurrency": {"1": {"runs": {
        "ours_served": [_spanned(2.1, True), _spanned(2.0, False), _spanned(2.0, False)],
        "ours_served_twin": [_spanned(2.6, False)],
        "nospec": [_spanned(9.0, True), _spanned(1.0, False)]}}}}
    path = tmp_path / "side_by_side.json"
    path.write_text(json.dumps(data))
    out = exploring_gpu_span([path], "ours_served")["1"]
    assert list(out) == ["side_by_side.json:ours_served"]
    row = out["side_by_side.json:ours_served"]
    assert row["batches"] == [1, 2]
    assert row["extra_ms_per_exploring_batch"] == pytest.approx(0.1 * 100)


def _phased(step_ms: float, schedule_ms: float, explores: bool) -> dict:
    run = _run(step_ms, 0.02 if explores else None)
    run["phases"]["schedule"]["ms_per_step"] = schedule_ms
    return run


def test_depth0_step_cost_leaves_exploring_batches_out(tmp_path, monkeypatch):
    """Ours' batches without an exploring step against plain V2's batches,
    each engine weighing the same. Negative control: a variant that keeps
    ours' exploring batch reads the step +0.55 ms, not +0.15."""
    data = {"by_concurrency": {"1": {"runs": {
        "nospec": [_phased(2.0, 0.10, False), _phased(2.2, 0.10, False)],
        "nospec_twin": [_phased(2.4, 0.12, False)],
        "ours_served": [_phased(2.3, 0.13, False), _phased(3.9, 0.13, True)],
        "ours_served_twin": [_phased(2.5, 0.15, False)]}}}}
    path = tmp_path / "side_by_side.json"
    path.write_text(json.dumps(data))
    row = depth0_step_cost([path], "ours_served", "nospec")["side_by_side.json"]["1"]
    assert row["engines"] == [2, 2]
    # plain V2: engines 2.1 and 2.4 -> 2.25; ours: 2.3 and 2.5 -> 2.4
    assert row["step"]["base_ms"] == pytest.approx(2.25)
    assert row["step"]["extra_ms"] == pytest.approx(0.15)
    assert row["schedule"]["extra_ms"] == pytest.approx(0.03)
    assert "gpu_span" not in row  # not timed in these batches

    import exploration_share as module
    keep_all = module._engine_means
    monkeypatch.setattr(module, "_engine_means", lambda runs, keep: keep_all(runs, lambda r: True))
    broken = depth0_step_cost([path], "ours_served", "nospec")["side_by_side.json"]["1"]
    assert broken["step"]["extra_ms"] == pytest.approx(0.55)
    assert broken["step"]["extra_ms"] != pytest.approx(row["step"]["extra_ms"])


def test_the_first_batch_excess_is_read_per_engine_against_its_own_later_batches(tmp_path):
    """Ours' first batch holds 300 ms more of execute_model than its later
    ones; plain's none. Each engine against its own median (the twin's
    slower batches do not move ours'); an engine with one batch, no row."""
    def batch(ms_per_step, repeat, steps=100):
        return {"repeat": repeat, "steps": steps,
                "phases": {"execute_model": {"calls": steps, "ms_per_step": ms_per_step}}}

    data = {"by_concurrency": {"1": {"runs": {
        "nospec": [batch(1.3, 0), batch(1.3, 1), batch(1.2, 2), batch(1.4, 3)],
        "ours_served": [batch(4.3, 0), batch(1.3, 1), batch(1.3, 2), batch(9.0, 3)],
        "ours_served_twin": [batch(2.0, 0), batch(2.0, 1), batch(2.0, 2)],
        "alone": [batch(5.0, 0)]}}}}
    path = tmp_path / "side_by_side.json"
    path.write_text(json.dumps(data))
    out = first_batch_excess([path])[str(path)]["1"]
    assert out == pytest.approx({"nospec": 0.0, "ours_served": 300.0, "ours_served_twin": 0.0})
