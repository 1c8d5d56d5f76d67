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
