"""scripts/gpu/lossless_summary.py on logs in the shape pytest -v -s and
tests/gpu/test_gpu_lossless.py print them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import lossless_summary  # noqa: E402

HEAD = "tests/gpu/test_gpu_lossless.py::"
PASSING = (
    f"{HEAD}test_a GPU AV on MRV2 with EAGLE (bfloat16): N=8000 chi-square p-values "
    "{'token1': 0.02, 'token2': 0.8}; AV counters {'steps': 10, 'slope': nan}\n"
    "PASSED\n"
)
FAILING = (
    f"{HEAD}test_b[holes] GPU AV on MRV2, depth 0/K alternating, holes (bfloat16): N=8000 "
    "chi-square p-values {'token1': 3e-09, 'token2': 0.5}; AV counters None\n"
    "FAILED\n"
)
CLOSING = "=========== 1 failed, 1 passed, 17 deselected in 256.33s (0:04:16) ===========\n"
SHORT_SUMMARY = f"FAILED {HEAD}test_b[holes] - AssertionError: {{'token1': 3e-09}}\n"


def test_runs_verdicts_and_closing_line_are_read():
    out = lossless_summary.summarise(PASSING + FAILING + SHORT_SUMMARY + CLOSING)
    assert [r["label"] for r in out["distribution_runs"]] == [
        "MRV2 with EAGLE", "MRV2, depth 0/K alternating, holes"]
    assert out["distribution_runs"][0]["av_counters"] == {"steps": 10, "slope": None}
    assert out["distribution_runs"][1]["av_counters"] is None
    # The short summary's line names test_b again: it must not add a test.
    assert out["verdicts"] == [{"test": "test_a", "verdict": "PASSED"},
                               {"test": "test_b[holes]", "verdict": "FAILED"}]
    assert out["min_p"] == 3e-09
    assert out["pytest_summary"].startswith("1 failed, 1 passed")


def test_a_test_cut_by_the_time_limit_is_not_read_as_passed():
    # Negative control for the verdicts: the log ends while test_c runs.
    cut = PASSING + f"{HEAD}test_c Writing model shards:   0%|\n"
    out = lossless_summary.summarise(cut)
    assert out["verdicts"][0]["verdict"] == "PASSED"
    assert out["verdicts"][1] == {"test": "test_c", "verdict": lossless_summary.CUT}
    assert out["pytest_summary"] is None


def test_main_writes_one_entry_per_log(tmp_path):
    log = tmp_path / "tests_gpu_lossless.log"
    log.write_text(PASSING + CLOSING)
    out = tmp_path / "summary.json"
    assert lossless_summary.main([str(log), "--machine", "m", "--date", "d", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["alpha_per_check"] == 1e-5
    assert list(data["runs"]) == ["tests_gpu_lossless.log"]
    assert data["runs"]["tests_gpu_lossless.log"]["verdicts"][0]["verdict"] == "PASSED"


def test_v1_async_and_negative_control_lines_are_read_and_kept_apart():
    text = (
        f"{HEAD}test_v1[float32] GPU AV (float32): N=8000 chi-square p-values "
        "{'token1': 0.4}; AV counters {'steps': 3}\nPASSED\n"
        f"{HEAD}test_async GPU AV async (bfloat16): N=8000 chi-square p-values "
        "{'token1': 0.3}; AV counters None\nPASSED\n"
        f"{HEAD}test_negative_control GPU lossy admission (bfloat16): chi-square p-values "
        "{'token1': 0.8, 'token2': 1e-18}\nPASSED\n"
    )
    out = lossless_summary.summarise(text)
    assert [(r["label"], r["dtype"], r["n"]) for r in out["distribution_runs"]] == [
        ("AV", "float32", 8000), ("AV async", "bfloat16", 8000)]
    assert out["negative_control_runs"] == [{
        "label": "lossy admission", "dtype": "bfloat16", "n": None,
        "p_values": {"token1": 0.8, "token2": 1e-18}, "av_counters": None}]
    # The lossy run's tiny p must not read as a lossless run's smallest.
    assert out["min_p"] == 0.3


def test_the_first_rounds_lines_without_a_dtype_are_read():
    text = (f"{HEAD}test_v1 GPU AV: N=4000 chi-square p-values {{'token1': 0.59}}; "
            "AV counters {'steps': 157}\nPASSED\n"
            f"{HEAD}test_negative_control GPU lossy admission: chi-square p-values "
            "{'token2': 7e-20}\nPASSED\n")
    out = lossless_summary.summarise(text)
    assert [(r["label"], r["dtype"], r["n"]) for r in out["distribution_runs"]] == [("AV", None, 4000)]
    assert out["negative_control_runs"][0]["p_values"] == {"token2": 7e-20}
