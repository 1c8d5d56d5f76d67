"""The side-by-side plot (benchmarks/plot_side_by_side.py): each arm's
paired ratios over the first arm, by concurrency, from the run's JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import plot_side_by_side  # noqa: E402


def _result():
    def summary(med, lo, hi):
        return {"tok_s_over_nospec": {"median": med, "min": lo, "max": hi}}

    return {
        "arms": {"nospec": {}, "ours": {}, "other": {}},
        "machine": {"device": "test"}, "repeats": 3, "date": "today",
        "by_concurrency": {
            "64": {"summary": {"ours": summary(0.9, 0.8, 1.1), "other": summary(1.2, 1.1, 1.3)}},
            "1": {"summary": {"ours": summary(1.0, 0.9, 1.05)}},
            "16": {"runs": {}},  # cut off before its summary
        },
    }


def test_series_are_by_concurrency_and_over_the_first_arm():
    base, series = plot_side_by_side.ratio_series(_result())
    assert base == "nospec"
    assert series == {"ours": [(1, 1.0, 0.9, 1.05), (64, 0.9, 0.8, 1.1)],
                      "other": [(64, 1.2, 1.1, 1.3)]}


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_side_by_side.plot(_result(), tmp_path / "ratios.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _pooled():
    def engine(ratio, lo, hi):
        return {"ratio": ratio, "ci90": [lo, hi], "engines": [[3, 3]]}

    return {
        "sittings": ["runs/r43/side_by_side.json"], "base": {"1": "nospec"},
        "by_concurrency": {
            "32": {"ours_over_nospec_by_engine": engine(0.90, 0.87, 0.95),
                   "ours_over_nospec_by_repeat": {"median": 0.92, "ci90": [0.9, 0.97]}},
            "1": {"ours_over_nospec_by_engine": engine(0.95, 0.93, 0.97),
                  "control_over_nospec_by_engine": engine(1.01, 0.98, 1.03)},
        },
    }


def test_a_pooled_run_plots_each_group_by_engine_with_its_interval():
    base, series = plot_side_by_side.engine_series(_pooled())
    assert base == "nospec"
    assert series == {"ours": [(1, 0.95, 0.93, 0.97), (32, 0.90, 0.87, 0.95)],
                      "control": [(1, 1.01, 0.98, 1.03)]}


def test_the_pooled_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_side_by_side.plot(_pooled(), tmp_path / "by_engine.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pooled_runs_are_named_by_their_folders_relative_to_the_pooled_json(tmp_path):
    folder = tmp_path / "results" / "round47"
    names = plot_side_by_side.run_names(
        ["../round43/side_by_side.json", "side_by_side.json"], folder)
    # A bare file name is the pooled JSON's own run, not a nameless one.
    assert names == ["round43", "round47"]
