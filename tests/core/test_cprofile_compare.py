"""scripts/gpu/cprofile_compare.py on profiles written by hand (the format
cProfile's `dump_stats` writes: a marshalled {(file, line, name): (calls,
primitive calls, own s, cumulative s, callers)})."""

from __future__ import annotations

import marshal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import cprofile_compare  # noqa: E402

SCHED = ("/site-packages/vllm/v1/core/sched/scheduler.py", 591, "schedule")
OUTPUT = ("/site-packages/vllm/v1/core/sched/scheduler.py", 2026, "update_from_output")
FORWARD = ("/site-packages/vllm/v1/worker/gpu/model_runner.py", 1718, "execute_model")
OURS = ("/repo/vllm_av/vllm/mrv2/manager.py", 433, "choose_depth")


def _write(path: Path, rows: dict, steps: int) -> str:
    stats = {k: (n, n, own, own, {}) for k, (n, own) in rows.items()}
    stats[SCHED] = (steps, steps, 0.001 * steps, 0.001 * steps, {})
    with open(path, "wb") as f:
        marshal.dump(stats, f)
    return str(path)


def test_extra_work_and_a_slower_process_are_told_apart(tmp_path):
    # Base: 100 steps, 0.5 ms of output code and 2 ms of forward per step.
    base = _write(tmp_path / "base.pstats", {OUTPUT: (100, 0.05), FORWARD: (100, 0.2)}, 100)
    # Other: every vLLM function 10% slower, plus 30 us per step of its own.
    other = _write(tmp_path / "other.pstats",
                   {OUTPUT: (100, 0.055), FORWARD: (100, 0.22), OURS: (100, 0.003)}, 100)
    out = cprofile_compare.compare([base], [other])
    assert abs(out["speed_factor"] - 1.1) < 1e-9
    assert [r["function"].split()[-1] for r in out["only_other"]] == ["choose_depth"]
    assert abs(out["only_other_us_per_step"] - 30.0) < 1e-6
    # Scaled by the speed factor, vLLM's forward adds nothing; ours adds 30 us.
    excess = {r["function"].split()[-1]: r["us_per_step"] for r in out["scaled_excess"]}
    assert abs(excess["choose_depth"] - 30.0) < 1e-6
    assert abs(excess["execute_model"]) < 1e-6
    # Unscaled (a comparison that took the slower process for extra work)
    # the forward would read 200 us per step more: the factor is what removes it.
    assert abs((0.22 - 0.2) / 100 * 1e6 - 200.0) < 1e-6


def test_files_of_one_group_are_pooled(tmp_path):
    a = _write(tmp_path / "a.pstats", {OUTPUT: (100, 0.05)}, 100)
    b = _write(tmp_path / "b.pstats", {OUTPUT: (300, 0.15)}, 300)
    table, steps = cprofile_compare.load([a, b])
    assert steps == 400 and table[OUTPUT][1] == 400


def test_the_same_work_reads_how_fast_each_group_ran_it(tmp_path):
    """`equal_work`: over functions both groups call equally often, other's
    own time over base's; functions called more often in one group, or too
    short to time, are left out. Negative control: with the other group's
    forward called twice as often, the forward drops out of the ratio."""
    base = _write(tmp_path / "base.pstats", {OUTPUT: (100, 0.05), FORWARD: (100, 0.2)}, 100)
    other = _write(tmp_path / "other.pstats",
                   {OUTPUT: (100, 0.06), FORWARD: (100, 0.22), OURS: (100, 0.003)}, 100)
    # `_write` gives both the scheduler's schedule at 1 ms per step.
    eq = cprofile_compare.compare([base], [other])["equal_work"]
    assert eq["functions"] == 3
    assert abs(eq["median"] - 1.1) < 1e-9  # of 1.0 (schedule), 1.1 and 1.2
    assert abs(eq["weighted"] - 0.38 / 0.35) < 1e-9
    twice = _write(tmp_path / "twice.pstats",
                   {OUTPUT: (100, 0.06), FORWARD: (200, 0.44)}, 100)
    eq = cprofile_compare.compare([base], [twice])["equal_work"]
    assert eq["functions"] == 2 and abs(eq["median"] - 1.1) < 1e-9  # 1.0 and 1.2
