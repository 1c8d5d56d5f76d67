"""benchmarks/bench_driver.py: `vllm bench serve` runs in one long-lived
process; a failed run is reported and the driver serves the next one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import sweep  # noqa: E402


def test_driver_reports_failures_and_keeps_serving(tmp_path, tiny_models):
    driver = sweep.BenchDriver(sys.executable, tmp_path / "driver.log")
    try:
        log = tmp_path / "run.log"
        assert driver.run(["--no-such-option"], log) != 0
        # The benchmark raises (no such prompt file): reported, the driver lives on.
        rc = driver.run(["--backend", "openai", "--base-url", "http://127.0.0.1:9",
                         "--model", str(tiny_models.target), "--dataset-name", "sharegpt",
                         "--dataset-path", str(tmp_path / "missing.json"),
                         "--num-prompts", "1"], log)
        assert rc != 0
        assert driver.run(["--help"], log) == 0
        assert driver.proc.poll() is None
        text = log.read_text()
        assert text.count("$ vllm bench serve") == 3  # every run logged to the run's file
        assert "--max-concurrency" in text  # the help text of the last run
    finally:
        driver.close()
    assert driver.proc.poll() is not None
