"""scripts/gpu/cprofile_first_batch.py on profiles written by hand (the
format cProfile's `dump_stats` writes: a marshalled {(file, line, name):
(calls, primitive calls, own s, cumulative s, callers)})."""

from __future__ import annotations

import marshal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import cprofile_first_batch  # noqa: E402

STEP = ("/x/site-packages/vllm/v1/worker/gpu/model_runner.py", 1718, "execute_model")
LOAD = ("/x/site-packages/torch/_inductor/codecache.py", 2272, "load_with_key")
SELECT = ("/repo/vllm_av/vllm/mrv2/manager.py", 610, "reallocate_drafts")


def _write(path: Path, rows: dict) -> str:
    stats = {k: (n, n, own, cum, {}) for k, (n, own, cum) in rows.items()}
    with open(path, "wb") as f:
        marshal.dump(stats, f)
    return str(path)


def test_a_one_time_cost_leads_and_equal_work_reads_zero(tmp_path):
    later = _write(tmp_path / "later.pstats",
                   {STEP: (256, 0.30, 0.60), SELECT: (1, 0.0001, 0.0002)})
    first = _write(tmp_path / "first.pstats",
                   {STEP: (256, 0.30, 0.80), SELECT: (1, 0.0001, 0.2002),
                    LOAD: (1, 0.18, 0.18)})
    f, lat = cprofile_first_batch.totals(first), cprofile_first_batch.totals(later)
    own = cprofile_first_batch.grown(f, lat, 1, 3)
    assert own[0] == {"function": "torch/_inductor/codecache.py:2272(load_with_key)",
                      "ms_more": 180.0, "calls_first": 1, "calls_later": 0}
    assert {r["function"].split(":")[0]: r["ms_more"] for r in own[1:]} == {
        "vllm/v1/worker/gpu/model_runner.py": 0.0, "/repo/vllm_av/vllm/mrv2/manager.py": 0.0}
    cum = cprofile_first_batch.grown(f, lat, 2, 2)
    assert [r["ms_more"] for r in cum] == [200.0, 200.0]
    # Swapped (a later batch dearer): nothing grows, the load reads negative.
    assert cprofile_first_batch.grown(lat, f, 1, 3)[-1]["ms_more"] == -180.0


def test_named_functions_are_listed_in_both_batches_even_where_absent(tmp_path):
    later = _write(tmp_path / "later.pstats", {STEP: (256, 0.30, 0.60)})
    first = _write(tmp_path / "first.pstats",
                   {STEP: (256, 0.45, 0.90), SELECT: (1, 0.0001, 0.0018)})
    f, lat = cprofile_first_batch.totals(first), cprofile_first_batch.totals(later)
    rows = cprofile_first_batch.named(f, lat, ["reallocate_drafts", "execute_model"])
    assert rows == [
        {"function": "/repo/vllm_av/vllm/mrv2/manager.py:610(reallocate_drafts)",
         "calls_first": 1, "own_ms_first": 0.1, "cum_ms_first": 1.8,
         "calls_later": 0, "own_ms_later": 0.0, "cum_ms_later": 0.0},
        {"function": "vllm/v1/worker/gpu/model_runner.py:1718(execute_model)",
         "calls_first": 256, "own_ms_first": 450.0, "cum_ms_first": 900.0,
         "calls_later": 256, "own_ms_later": 300.0, "cum_ms_later": 600.0}]
    assert cprofile_first_batch.named(f, lat, ["no_such_function"]) == []
