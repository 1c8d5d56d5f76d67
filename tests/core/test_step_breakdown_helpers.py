"""The GPU step breakdown's trace arithmetic (scripts/gpu/step_breakdown.py),
checked on the CPU with profiler-like events: the share of a batch the GPU
was busy is what tells a host-bound engine from a device-bound one."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import step_breakdown  # noqa: E402


def _event(device: str, start_us: float, end_us: float, name: str = "k", parent=None):
    return SimpleNamespace(device_type=f"DeviceType.{device}", name=name, cpu_parent=parent,
                           time_range=SimpleNamespace(start=start_us, end=end_us))


def test_gpu_busy_time_counts_overlapping_device_work_once_and_ignores_the_host():
    events = [
        _event("CUDA", 0, 1000), _event("CUDA", 500, 1500),  # two streams overlapping
        _event("CUDA", 3000, 4000), _event("CUDA", 3200, 3300),  # one inside another
        _event("CPU", 0, 10_000),  # host work is not device time
    ]
    assert step_breakdown.gpu_busy_ms(events) == 2.5
    # Negative control: summing the intervals would count the overlaps twice.
    assert sum(e.time_range.end - e.time_range.start for e in events[:4]) / 1e3 == 3.1


def test_gpu_busy_time_of_no_device_events_is_zero():
    assert step_breakdown.gpu_busy_ms([_event("CPU", 0, 5)]) == 0.0


def test_trace_gaps_attribute_the_gpu_idle_time_to_the_host_functions_running_then(tmp_path):
    """A synthetic timeline: device work at 0-100, 150-250 (two kernels
    overlapping) and 400-500 us, so the GPU waits 50 + 150 us; host
    functions overlapping those waits get exactly the overlap, not their
    whole duration (the negative control's figure)."""
    import gzip
    import json

    import trace_gaps

    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [
        x("kernel", "gemm", 0, 100), x("kernel", "attn", 150, 60), x("gpu_memcpy", "copy", 180, 70),
        x("kernel", "gemm", 400, 100),
        x("python_function", "outer", 0, 500),
        x("python_function", "schedule", 90, 70),  # 50 us of it in the first wait
        x("python_function", "build_metadata", 260, 130),  # inside the second wait
        x("python_function", "forward", 0, 90),  # while the GPU works: never listed
        x("cpu_op", "aten::item", 300, 10),  # an op: counted through its caller
        x("cuda_runtime", "cudaStreamSynchronize", 100, 20),  # a wait, listed
        x("python_function", "monitor_wait", 0, 500, tid=2),  # another thread: never listed
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    report = trace_gaps.analyse(trace_gaps.load_events(path), min_gap_us=100)
    assert report["gpu_busy_ms"] == 0.3 and report["gpu_idle_ms"] == 0.2
    assert (report["gaps"], report["long_gaps"], report["long_gap_ms"]) == (2, 1, 0.15)
    inside = {r["function"]: r["idle_ms_inside"] for r in report["host_functions_during_idle"]}
    assert inside == {"outer": 0.2, "build_metadata": 0.13, "schedule": 0.05,
                      "cudaStreamSynchronize": 0.02}
    assert inside["schedule"] != 70 / 1e3  # control: its whole duration
    # Self time: a caller keeps the idle time its callees did not take (the
    # synchronize runs inside `schedule`; `outer` alone spans 250-260 and
    # 390-400), so the shares add up to the idle time.
    own = {r["function"]: round(r["self_idle_ms"], 9) for r in report["host_functions_by_self_idle"]}
    assert own == {"build_metadata": 0.13, "schedule": 0.03, "cudaStreamSynchronize": 0.02,
                   "outer": 0.02}
    assert abs(sum(own.values()) - report["gpu_idle_ms"]) < 1e-9


def test_the_device_time_table_lists_profiled_ops_by_their_own_device_time():
    """On the CPU the device columns are zero; the table must still come
    out (the sort key differs between torch versions) and name the ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    table = step_breakdown.device_time_table(prof, rows=10)
    assert "aten::mm" in table and "Self" in table
