"""The cost corrections of timed steps reach /metrics
(vllm_av/vllm/metrics.py), so an operator sees how far real steps are from
the start-up profile."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from vllm_av.core.cost_model import CostModel  # noqa: E402
from vllm_av.core.estimator import OnlineAcceptanceEstimator  # noqa: E402
from vllm_av.core.verifier import AdaptiveVerifier  # noqa: E402
from vllm_av.vllm.metrics import AVCollector, write_snapshot  # noqa: E402

K = 3


def _verifier():
    cost = CostModel.from_samples({1: [1.0], 64: [2.0]}, {1: [0.5], 64: [1.0]}, graph_sizes=[])
    return AdaptiveVerifier(K, cost, OnlineAcceptanceEstimator(K))


def _families(directory):
    return {f.name: f for f in AVCollector(str(directory)).collect()}


def test_timed_steps_show_as_cost_scales(tmp_path):
    v = _verifier()
    write_snapshot(str(tmp_path), v)
    fams = _families(tmp_path)
    # Nothing timed yet: the families exist and are empty.
    assert fams["vllm_av:draft_cost_scale"].samples == []
    assert fams["vllm_av:verify_cost_scale"].samples == []

    predicted = float(v.cost.profiled_draft_cost(8, K, K))
    for _ in range(50):
        v.observe_draft_time(K, 8, 12 * predicted)  # drafting 12x its profile
        v.observe_verify_time(16, float(v.cost.verify(16)))  # verify as profiled
    write_snapshot(str(tmp_path), v)
    fams = _families(tmp_path)
    draft = {s.labels["depth"]: s.value for s in fams["vllm_av:draft_cost_scale"].samples}
    verify = {s.labels["tokens_log2"]: s.value for s in fams["vllm_av:verify_cost_scale"].samples}
    assert list(draft) == [str(K)] and draft[str(K)] > 6, draft
    assert list(verify) == ["4"] and np.isclose(verify["4"], 1.0, rtol=0.05), verify


def test_the_stale_row_slope_shows(tmp_path):
    # 1 (rows as they are) until fitted, then the fitted slope.
    v = _verifier()
    write_snapshot(str(tmp_path), v)
    assert _families(tmp_path)["vllm_av:stale_row_slope"].samples[0].value == 1.0
    v.stats.stale_row_slope = 0.25  # as the verifier sets it after a fit
    write_snapshot(str(tmp_path), v)
    assert _families(tmp_path)["vllm_av:stale_row_slope"].samples[0].value == 0.25


def test_measured_cost_of_a_model_free_drafter_shows(tmp_path):
    # ngram / suffix: a zero drafting profile, so timed drafting steps are
    # kept as measured costs, not ratios.
    cost = CostModel.from_samples({1: [1.0], 64: [2.0]}, {1: [0.0]}, graph_sizes=[])
    v = AdaptiveVerifier(K, cost, OnlineAcceptanceEstimator(K))
    write_snapshot(str(tmp_path), v)
    assert _families(tmp_path)["vllm_av:draft_cost_measured_ms"].samples == []
    for _ in range(5):
        v.observe_draft_time(K, 16, 1.5)
    write_snapshot(str(tmp_path), v)
    fams = _families(tmp_path)
    measured = {s.labels["reqs_log2"]: s.value
                for s in fams["vllm_av:draft_cost_measured_ms"].samples}
    assert measured == {"4": 1.5}
    assert fams["vllm_av:draft_cost_scale"].samples == []


def test_steps_carrying_prompt_tokens_are_tallied_apart(tmp_path):
    # They correct the verification table like any timed step, and their
    # own ratio shows beside it (diagnostic: is a bucket's correction made
    # by prefill steps?). Decode steps at the profile, prefill steps at 3x.
    v = _verifier()
    predicted = float(v.cost.verify(300))  # bucket 8
    for _ in range(20):
        v.observe_verify_time(300, predicted)
        v.observe_verify_time(300, 3.0 * predicted, prefill=True)
    write_snapshot(str(tmp_path), v)
    fams = _families(tmp_path)
    apart = {s.labels["tokens_log2"]: s.value
             for s in fams["vllm_av:prefill_step_cost_scale"].samples}
    verify = {s.labels["tokens_log2"]: s.value for s in fams["vllm_av:verify_cost_scale"].samples}
    assert list(apart) == ["8"] and np.isclose(apart["8"], 3.0, rtol=0.01), apart
    assert list(verify) == ["8"] and 0.99 <= verify["8"] <= 3.01, verify  # both kinds
    assert v.cost.verify_scale.get(8) == verify["8"]  # the diagnostic is not priced


def test_the_drafter_catch_up_counter_shows_when_given(tmp_path):
    write_snapshot(str(tmp_path), _verifier())
    assert "vllm_av:drafter_catch_up_tokens" not in _families(tmp_path)  # option off
    write_snapshot(str(tmp_path), _verifier(), extra={"catch_up_tokens": 1152})
    fam = _families(tmp_path)["vllm_av:drafter_catch_up_tokens"]
    assert [s.value for s in fam.samples if s.name.endswith("_total")] == [1152]
    assert "vllm_av:drafter_catch_up_holes_left" not in _families(tmp_path)  # not given
    write_snapshot(str(tmp_path), _verifier(),
                   extra={"catch_up_tokens": 1152, "catch_up_holes_left": 14})
    fam = _families(tmp_path)["vllm_av:drafter_catch_up_holes_left"]
    assert [s.value for s in fam.samples if s.name.endswith("_total")] == [14]


def test_depths_chosen_show_per_depth(tmp_path):
    # A drafter that costs 10x a plain step: the policy drafts nothing,
    # except where a floor holds the depth at K; /metrics counts both.
    cost = CostModel.from_samples({1: [1.0], 64: [1.0]}, {1: [10.0]}, graph_sizes=[])
    v = AdaptiveVerifier(K, cost, OnlineAcceptanceEstimator(K))
    write_snapshot(str(tmp_path), v)
    assert _families(tmp_path)["vllm_av:depth_chosen_steps"].samples == []
    ids = ["a", "b"]
    chosen = [v.choose_depth(ids, num_sampling=2, num_other_tokens=2, min_depth=K if i % 4 == 0
                             else 0) for i in range(40)]
    write_snapshot(str(tmp_path), v)
    fams = _families(tmp_path)
    by_depth = {s.labels["depth"]: s.value for s in fams["vllm_av:depth_chosen_steps"].samples
                if s.name.endswith("_total")}
    assert sorted(by_depth) == [str(d) for d in range(K + 1)]
    assert {d: by_depth[str(d)] for d in range(K + 1)} == {d: chosen.count(d) for d in range(K + 1)}
    assert by_depth["0"] == v.stats.zero_depth_steps >= 20 and by_depth[str(K)] >= 10


def test_a_second_engine_in_the_process_registers_without_clashing(tmp_path, monkeypatch):
    """Two engines built in one process, each with a snapshot already in its
    metrics directory: the second must start (prometheus_client refuses a
    second collector naming the same metrics), and /metrics follows it."""
    from prometheus_client import CollectorRegistry, generate_latest

    import vllm_av.vllm.metrics as metrics

    registry = CollectorRegistry()
    monkeypatch.setattr("prometheus_client.REGISTRY", registry)
    monkeypatch.setattr(metrics, "_collector", None)
    first, second = tmp_path / "first", tmp_path / "second"
    for directory, drafted in ((first, 3), (second, 5)):
        directory.mkdir()
        v = _verifier()
        v.stats.drafted = drafted
        write_snapshot(str(directory), v)
    metrics.register_collector(str(first))
    metrics.register_collector(str(second))
    text = generate_latest(registry).decode()
    assert text.count("# TYPE vllm_av:budget gauge") == 1, text
    assert "vllm_av:draft_tokens_drafted_total 5.0" in text, text


def test_background_snapshots_leave_the_write_off_the_engines_thread(tmp_path, monkeypatch):
    # A served engine (metrics_interval > 1) snapshots on its own thread and
    # writes on the writer's; snapshots posted while one is being written
    # coalesce to the latest. The write is made slow to tell the two apart.
    import time

    import vllm_av.vllm.metrics as metrics
    from vllm_av.vllm.metrics import flush_snapshots, read_snapshot

    real_write = metrics._write

    def slow_write(directory, rank, snap):
        time.sleep(0.2)
        real_write(directory, rank, snap)

    monkeypatch.setattr(metrics, "_write", slow_write)
    v = _verifier()
    t0 = time.perf_counter()
    for steps in range(1, 6):
        v.stats.num_steps = steps
        write_snapshot(str(tmp_path), v, background=True)
    posted = time.perf_counter() - t0
    assert posted < 0.1, posted  # five posts, no write waited for
    assert flush_snapshots(5.0)
    assert read_snapshot(str(tmp_path))["steps"] == 5  # the latest one landed
    # Negative control: a foreground snapshot waits for its write.
    t0 = time.perf_counter()
    write_snapshot(str(tmp_path), v)
    assert time.perf_counter() - t0 >= 0.2


def test_background_writes_are_at_most_twice_a_second_and_the_last_lands(tmp_path, monkeypatch):
    # A served engine posts a snapshot every 16 steps (every few ms under
    # load); the writer encodes and writes at most one per WRITE_MIN_PERIOD_S,
    # and the latest posted one is on disk after a flush. Negative control:
    # with no minimum period it writes far more often.
    import time

    import vllm_av.vllm.metrics as metrics

    def count_writes(period: float) -> tuple[int, dict]:
        monkeypatch.setattr(metrics, "WRITE_MIN_PERIOD_S", period)
        written = []
        real_write = metrics._write
        monkeypatch.setattr(metrics, "_write",
                            lambda d, r, snap: (written.append(snap["steps"]), real_write(d, r, snap)))
        writer = metrics._BackgroundWriter()
        t_end = time.monotonic() + 1.2
        steps = 0
        while time.monotonic() < t_end:
            steps += 1
            writer.post(str(tmp_path), 0, {"steps": steps})
            time.sleep(0.005)
        assert writer.flush(5.0)
        return len(written), metrics.read_snapshot(str(tmp_path)), steps

    n, snap, steps = count_writes(0.5)
    assert 2 <= n <= 4, n  # at 0, about 0.5 and 1.0 s, and the last after the posts
    assert snap["steps"] == steps  # the latest posted snapshot landed
    n_free, snap, steps = count_writes(0.0)
    assert n_free >= 3 * n and snap["steps"] == steps, (n_free, n)
