"""AV metrics on vLLM's /metrics.

The verifier lives in the worker process, /metrics is served by the API
server process, and vLLM 0.32 with one API server does not run Prometheus in
multiprocess mode. So the worker writes a small JSON snapshot of its
counters every few steps (atomically: write, then rename) into a directory
named in our options, and a collector registered in the process that built
the config reads it at scrape time. A scrape therefore lags the engine by
at most `metrics_interval` steps. Served engines (an interval above 1)
hand the file write to a background thread: the snapshot is taken on the
engine's thread (about 20 us), the write (0.2 ms on the idle development
machine, 1.7 ms while it ran other work) happens beside it, at most twice
a second (WRITE_MIN_PERIOD_S).
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import threading
import time

SNAPSHOT_NAME = "av_stats_rank{rank}.json"
PREFIX = "vllm_av:"


def snapshot(verifier, extra: dict | None = None) -> dict:
    """The verifier's counters and tables; `extra`: counters kept beside it
    (the drafter catch-up's)."""
    s = verifier.stats
    est = verifier.estimator
    cost = getattr(verifier, "cost", None)
    return {
        "steps": s.num_steps,
        "drafted": s.drafted,
        "verified": s.verified,
        "admitted": s.admitted,
        "accepted": s.accepted,
        "trimmed": s.trimmed,
        "budget": s.last_budget,
        "depth": s.last_depth,
        "depth_steps": s.depth_steps,
        "zero_depth_steps": s.zero_depth_steps,
        "depth_counts": list(getattr(s, "depth_counts", [])),
        # "head": a trained confidence head scored the drafts; the estimator's
        # fields and the accepted / verified counts are then not ours to give.
        "confidence_source": getattr(s, "confidence_source", "estimator"),
        # The slope of the map from one-step-old rows to the next drafts'
        # acceptance, for the depth and budget (vllm_av/core/stale_rows.py).
        "stale_row_slope": getattr(s, "stale_row_slope", 1.0),
        "slope": est.slope,
        "intercepts": est.intercepts,
        "predicted": s.predicted.tolist(),
        "observed": s.observed.tolist(),
        "labelled": s.labelled.tolist(),
        # Where timed steps corrected the cost tables (COST_GAUGES).
        **{key: {str(k): v for k, v in getattr(cost, attr, {}).items()}
           for key, attr, _, _ in COST_GAUGES},
        PREFILL_GAUGE[0]: {str(k): v for k, v in
                           getattr(verifier, "prefill_step_scale", {}).items()},
        **(extra or {}),
    }


def write_snapshot(directory: str, verifier, rank: int = 0, extra: dict | None = None,
                   background: bool = False) -> None:
    """Snapshot the verifier now; write it now, or (`background`) on the
    writer thread, which writes the latest snapshot of each file."""
    snap = snapshot(verifier, extra)
    if background:
        _WRITER.post(directory, rank, snap)
    else:
        _write(directory, rank, snap)


def _write(directory: str, rank: int, snap: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    # json.dumps encodes in C; json.dump to a file runs the pure-Python
    # encoder, holding the GIL that the engine's thread needs for longer.
    text = json.dumps(snap)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, SNAPSHOT_NAME.format(rank=rank)))


# At most one background write per this many seconds: a write encodes JSON
# in Python, holding the GIL the engine's thread needs (on the H200 about a
# fifth of a millisecond, every 16 steps of a few milliseconds). Snapshots
# posted in between replace each other, so the last one is written at most
# this long after it was posted.
WRITE_MIN_PERIOD_S = 0.5


class _BackgroundWriter:
    """One daemon thread writing the latest posted snapshot per file, at
    most once per WRITE_MIN_PERIOD_S; a snapshot posted while an older one
    waits replaces it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: dict[tuple[str, int], dict] = {}
        self._busy = False
        self._last_write = float("-inf")
        self._thread: threading.Thread | None = None

    def post(self, directory: str, rank: int, snap: dict) -> None:
        with self._cv:
            self._pending[(directory, rank)] = snap
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="vllm-av-metrics",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every posted snapshot is written (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending))
                wait = self._last_write + WRITE_MIN_PERIOD_S - time.monotonic()
                if wait > 0:
                    self._cv.wait(timeout=wait)  # a new post wakes it: wait out the rest
                    continue
                batch, self._pending = self._pending, {}
                self._busy = True
            try:
                for (directory, rank), snap in batch.items():
                    try:
                        _write(directory, rank, snap)
                    except OSError:
                        pass  # a full or removed directory: the next snapshot retries
            finally:
                with self._cv:
                    self._busy = False
                    self._last_write = time.monotonic()
                    self._cv.notify_all()


_WRITER = _BackgroundWriter()
atexit.register(_WRITER.flush, 2.0)


def flush_snapshots(timeout: float = 5.0) -> bool:
    """Wait for background snapshot writes of this process."""
    return _WRITER.flush(timeout)


def read_snapshot(directory: str, rank: int = 0) -> dict | None:
    try:
        with open(os.path.join(directory, SNAPSHOT_NAME.format(rank=rank))) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class AVCollector:
    """Prometheus collector over the worker's latest snapshot."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = read_snapshot(self.directory)
        if snap is None:
            return
        # With a trained confidence head there is no estimator of ours: its
        # gauges and the verdict counts it keeps are left out, not shown as 0.
        estimated = snap.get("confidence_source", "estimator") == "estimator"
        for name, doc in (
            ("drafted", "Draft tokens proposed by the drafter"),
            ("admitted", "Draft tokens admitted for verification by the budget"),
            ("verified", "Draft tokens verified by the target"),
            ("accepted", "Draft tokens accepted by verification"),
            ("trimmed", "Draft tokens trimmed before verification"),
        ):
            if not estimated and name in ("verified", "accepted"):
                continue
            yield CounterMetricFamily(
                f"{PREFIX}draft_tokens_{name}", doc, value=snap[name]
            )
        yield GaugeMetricFamily(
            f"{PREFIX}budget", "Verification budget (draft slots) of the last step",
            value=snap["budget"],
        )
        yield GaugeMetricFamily(
            f"{PREFIX}draft_depth",
            "Drafting depth (draft tokens per request) chosen for the last step",
            value=snap.get("depth", 0),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}stale_row_slope",
            "Slope of the map from a request's one-step-old survival row to its next "
            "drafts' acceptance, for the depth and budget (1: the row as it is)",
            value=snap.get("stale_row_slope", 1.0),
        )
        yield CounterMetricFamily(
            f"{PREFIX}depth_steps", "Steps whose drafting depth was chosen adaptively",
            value=snap.get("depth_steps", 0),
        )
        yield CounterMetricFamily(
            f"{PREFIX}zero_depth_steps", "Steps that chose to draft nothing (depth 0)",
            value=snap.get("zero_depth_steps", 0),
        )
        by_depth = CounterMetricFamily(
            f"{PREFIX}depth_chosen_steps",
            "Steps whose drafting depth was chosen adaptively, per depth",
            labels=["depth"],
        )
        for depth, n in enumerate(snap.get("depth_counts", [])):
            by_depth.add_metric([str(depth)], n)
        yield by_depth
        if "catch_up_tokens" in snap:
            yield CounterMetricFamily(
                f"{PREFIX}drafter_catch_up_tokens",
                "Positions the draft model caught up after steps that skipped it",
                value=snap["catch_up_tokens"],
            )
        if "catch_up_holes_left" in snap:
            yield CounterMetricFamily(
                f"{PREFIX}drafter_catch_up_holes_left",
                "Positions the draft model missed that no catch-up reached "
                "(before the sequence's known start, or past the drafter's buffers)",
                value=snap["catch_up_holes_left"],
            )
        yield GaugeMetricFamily(
            f"{PREFIX}confidence_from_head",
            "1 when the drafter's trained confidence head scores the drafts, "
            "0 when the online estimator does",
            value=0 if estimated else 1,
        )
        if estimated:
            yield from self._estimator_gauges(snap)
        # Cost corrections from timed steps, keyed by an integer label.
        for key, _, label, doc in (*COST_GAUGES, PREFILL_GAUGE):
            gauge = GaugeMetricFamily(f"{PREFIX}{key}", doc, labels=[label])
            for k, value in sorted(snap.get(key, {}).items(), key=lambda kv: int(kv[0])):
                gauge.add_metric([k], value)
            yield gauge

    @staticmethod
    def _estimator_gauges(snap: dict):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(
            f"{PREFIX}estimator_slope", "Shared slope of the acceptance estimator",
            value=snap["slope"],
        )
        icpt = GaugeMetricFamily(
            f"{PREFIX}estimator_intercept", "Per-position intercept of the estimator",
            labels=["position"],
        )
        for i, b in enumerate(snap["intercepts"]):
            icpt.add_metric([str(i)], b)
        yield icpt
        pred = GaugeMetricFamily(
            f"{PREFIX}acceptance_predicted",
            "Mean predicted conditional acceptance over labelled drafts, per position",
            labels=["position"],
        )
        obs = GaugeMetricFamily(
            f"{PREFIX}acceptance_observed",
            "Observed conditional acceptance over labelled drafts, per position",
            labels=["position"],
        )
        for i, n in enumerate(snap["labelled"]):
            if n > 0:
                pred.add_metric([str(i)], snap["predicted"][i] / n)
                obs.add_metric([str(i)], snap["observed"][i] / n)
        yield pred
        yield obs


# (snapshot key = metric name, CostModel attribute, label, help) of the
# cost corrections.
COST_GAUGES = (
    ("draft_cost_scale", "draft_scale", "depth",
     "Measured / profiled cost of a drafting step, per depth (timed steps)"),
    ("verify_cost_scale", "verify_scale", "tokens_log2",
     "Measured / profiled cost of a step that verifies drafts, apart from drafting, "
     "per bucket of floor(log2(tokens)) (timed steps)"),
    ("plain_verify_cost_scale", "plain_verify_scale", "tokens_log2",
     "Measured / profiled cost of a step that verifies no draft (run as plain "
     "decoding), per bucket of floor(log2(tokens)) (timed steps)"),
    ("draft_cost_measured_ms", "draft_measured", "reqs_log2",
     "Measured drafting cost (ms per step) of a drafter with no profiled cost "
     "(ngram, suffix), per bucket of floor(log2(requests)) (timed steps)"),
)
# Diagnostic, never priced: measured / profiled cost of the timed steps that
# carried prompt tokens (AdaptiveVerifier.prefill_step_scale), set beside
# verify_cost_scale, which takes every timed step.
PREFILL_GAUGE = (
    "prefill_step_cost_scale", None, "tokens_log2",
    "Measured / profiled cost of a step carrying prompt tokens, apart from "
    "drafting, per bucket of floor(log2(tokens)) (timed steps; diagnostic, not priced)",
)


_collector: AVCollector | None = None


def register_collector(directory: str) -> None:
    """Serve the AV metrics of the engine whose snapshots go to `directory`.

    One collector per process, pointed at the latest engine's directory: a
    second engine built in the same process (offline `LLM` use) must not
    register the same metric names again, which prometheus_client refuses
    at start-up once a snapshot is there to name them."""
    global _collector
    if _collector is not None:
        _collector.directory = directory
        return
    from prometheus_client import REGISTRY

    _collector = AVCollector(directory)
    REGISTRY.register(_collector)
