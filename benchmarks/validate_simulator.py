"""Validate the trace-driven simulator against throughput measured on an H200.

    python benchmarks/validate_simulator.py

Measured (benchmarks/results/h200_20261129, scripts/gpu/step_breakdown.py):
vLLM 0.32.0, Qwen2.5-Coder 1.5B target / 0.5B draft, bf16, HumanEval
prompts, temperature 1, ignore_eos, 128 output tokens per request, C
requests submitted at once; `plain_tok_s` (nothing added) is the truth, and
a second "timed" run gives per-phase mean ms per call.

Cost tables the simulator is run under:
- `measured`: built from the timed phases (`measured_step_cost`):
  verify(n) from `target_step` of nospec (n = C), k3 (n = 4C) and k7
  (n = 8C), pooled to be non-decreasing in n (isotonic fit, ties averaged),
  linear in between; drafting D(r, d) from `drafting` of k3 (d = 3) and k7
  (d = 7), isotonic in r, linear in depth through D(r, 0) = 0; a per-step
  overhead by request count, `schedule + sample_tokens - drafting` (the
  rejection sampler and bookkeeping are inside `sample_tokens`), one curve
  for spec steps (k3 and k7 pooled) and one for nospec
  (`schedule + sample_tokens`), charged through `StepCost.overhead_ms`.
- `startup`: the table our start-up profile wrote on that H200
  (cost_table_h200_ours_startup.json), as `benchmarks/simulate.py
  --cost-json` would use it (no overhead).

The simulator replays the HumanEval traces in batch mode (`refill=False`:
C requests start together, the run ends with the last one, throughput =
tokens / makespan, like the measurement), with every tape of at least 128
tokens cut to 128 (the measured runs ignore EOS; shorter tapes ended on one
and are left out). C=1 is every such tape run alone (tokens and time
summed); C=64 and 256 are averaged over a few seeds. Writes
benchmarks/results/h200_20261129/simulator_validation.json and prints a
Markdown table. See docs/simulator.md, "Validation against the H200".
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

from vllm_av.core.cost_model import CostCurve, CostModel
from vllm_av.core.cost_model import isotonic as fit_isotonic
from vllm_av.sim import StepCost, TraceSet, load_traces, make_policy, simulate
from vllm_av.sim.traces import PromptTape

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "h200_20261129"
ARMS = {"nospec": ("no_spec", 0), "k3": ("fixed_k3", 3), "k7": ("fixed_k7", 7)}
K = 7  # depth of the draft table handed to the policies


def isotonic(x, y):
    """Non-decreasing least-squares fit of y on x (pool adjacent violators).

    Points at the same x are averaged first. Returns (xs, fit) over the
    sorted distinct x; where y is already non-decreasing, fit == y.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    xs = np.unique(x)
    means = np.array([y[x == v].mean() for v in xs])
    weights = np.array([(x == v).sum() for v in xs], dtype=np.float64)
    return xs, fit_isotonic(means, weights)


def _curve(points) -> CostCurve:
    xs, fit = isotonic([p[0] for p in points], [p[1] for p in points])
    return CostCurve(xs.astype(int), fit, graph_sizes=[])  # linear, no staircase


def load_breakdowns(directory: Path = RESULTS) -> dict:
    return {arm: json.loads((directory / f"breakdown_{arm}.json").read_text())
            for arm in ARMS}


def measured_points(breakdowns: dict) -> dict:
    """The (size, ms) points the measured table is fitted to."""
    verify, draft, overhead = [], {}, {"spec": [], "nospec": []}
    for arm, (_, depth) in ARMS.items():
        for run in breakdowns[arm]["runs"]:
            c, ph = run["concurrency"], run["phases"]
            ms = {k: v["mean_ms"] for k, v in ph.items()}
            verify.append((c * (depth + 1), ms["target_step"]))
            if depth:
                draft.setdefault(depth, []).append((c, ms["drafting"]))
                overhead["spec"].append(
                    (c, ms["schedule"] + ms["sample_tokens"] - ms["drafting"]))
            else:
                overhead["nospec"].append((c, ms["schedule"] + ms.get("sample_tokens", 0.0)))
    return {"verify": verify, "draft": draft, "overhead": overhead}


class MeasuredStepCost(StepCost):
    """StepCost with drafting priced by depth and a per-step overhead.

    D(r, d): piecewise linear in d through (0, 0) and the fitted depths,
    extrapolated past the deepest two. A step of per-request depths
    `drafted` costs sum_j [D(n_j, j + 1) - D(n_j, j)], n_j = requests
    drafting deeper than j: D(R, d) when every request drafts d.
    """

    def __init__(self, verify: CostCurve, draft: dict[int, CostCurve],
                 overhead: dict[str, CostCurve], K: int = K):
        self.draft_curves = dict(sorted(draft.items()))
        self.overhead_curves = overhead
        deepest = max(self.draft_curves)
        model = CostModel(verify, self.draft_curves[deepest], self.draft_curves)
        super().__init__(model, K)
        if deepest != K:
            raise ValueError(f"draft table at depth {deepest}, policies expect K={K}")

    def depth_cost(self, num_reqs: int, depth: int) -> float:
        if num_reqs <= 0 or depth <= 0:
            return 0.0
        knots = [0] + list(self.draft_curves)
        costs = [0.0] + [float(c(num_reqs)) for c in self.draft_curves.values()]
        if depth <= knots[-1]:
            return float(np.interp(depth, knots, costs))
        slope = (costs[-1] - costs[-2]) / (knots[-1] - knots[-2])
        return costs[-1] + slope * (depth - knots[-1])

    def draft_ms(self, drafted: np.ndarray) -> float:
        depth = int(drafted.max()) if drafted.size else 0
        total = 0.0
        for j in range(depth):
            n = int((drafted > j).sum())
            total += self.depth_cost(n, j + 1) - self.depth_cost(n, j)
        return total

    def overhead_ms(self, drafted: np.ndarray) -> float:
        if drafted.size == 0:
            return 0.0
        kind = "spec" if drafted.max() > 0 else "nospec"
        return float(self.overhead_curves[kind](int(drafted.size)))


def measured_step_cost(breakdowns: dict) -> MeasuredStepCost:
    pts = measured_points(breakdowns)
    return MeasuredStepCost(
        _curve(pts["verify"]),
        {d: _curve(p) for d, p in pts["draft"].items()},
        {k: _curve(p) for k, p in pts["overhead"].items()},
    )


def truncated(traces: TraceSet, length: int) -> TraceSet:
    """Tapes of at least `length` tokens, cut to `length` (a fixed output length)."""
    tapes = [PromptTape(t.prompt_id, t.labels[:length], t.features[:length],
                        t.bonus_accept[:length])
             for t in traces.tapes if t.length >= length]
    return TraceSet(f"{traces.name}_{length}", traces.K, tapes)


def simulate_arm(traces: TraceSet, policy: str, cost: StepCost, C: int, seeds,
                 persist: bool = False, **policy_kw) -> dict:
    """Batch-mode runs summed: C=1 runs every tape alone, otherwise one batch per seed.
    `policy_kw` go to make_policy (belief, calibrate); `persist`: one policy
    for all the runs, in order (a server's verifier outlives its requests),
    else a fresh one per run."""
    runs = []
    shared = make_policy(policy, traces.K, cost, **policy_kw) if persist else None

    def pol():
        return shared if persist else make_policy(policy, traces.K, cost, **policy_kw)

    if C == 1:
        for i, tape in enumerate(traces.tapes):
            one = TraceSet(traces.name, traces.K, [tape])
            runs.append(simulate(one, pol(), cost, 1,
                                 max_steps=10_000, warmup_steps=0, seed=i, refill=False))
    else:
        for s in seeds:
            # Rotate the pool per seed so the slot -> prompt map changes too.
            k = (s * 7) % len(traces.tapes)
            rot = TraceSet(traces.name, traces.K, traces.tapes[k:] + traces.tapes[:k])
            runs.append(simulate(rot, pol(), cost,
                                 C, max_steps=10_000, warmup_steps=0, seed=s, refill=False))
    tokens = sum(r.tokens for r in runs)
    time_ms = sum(r.time_ms for r in runs)
    steps = sum(r.steps for r in runs)
    return {
        "tok_s": tokens / (time_ms / 1e3),
        "steps": steps / len(runs),  # per batch (makespan in steps)
        "ms_per_step": time_ms / steps,
        "tok_per_req_step": tokens / (steps * C),  # over the makespan, as measured
        "accepted_per_active_step": float(np.mean([r.accepted_per_step for r in runs])),
        "runs": len(runs),
        "tok_s_range": [min(r.throughput for r in runs), max(r.throughput for r in runs)],
    }


# What our adaptive depth would do under the measured H200 costs, planning
# with the start-up table (as served that day), with and without the
# correction from timed drafting and steps, and with the true table. One
# verifier per arm and concurrency serves all its batches in turn, as in a
# server (C=1: the 38 tapes one after the other; C>1: the seeds' batches).
WHAT_IF = {
    "no_spec": ("no_spec", {}),
    "fixed_k3": ("fixed_k3", {}),
    "fixed_k7": ("fixed_k7", {}),
    "ours, start-up table": ("ours_adaptive_depth", {"belief": "startup", "calibrate": False}),
    "ours, start-up table + timed steps": ("ours_adaptive_depth",
                                           {"belief": "startup", "calibrate": True}),
    "ours, true table": ("ours_adaptive_depth", {"calibrate": False}),
}


def what_if(traces, measured: StepCost, startup: CostModel, seeds,
            concurrency=(1, 64, 256)) -> list[dict]:
    rows = []
    for label, (policy, kw) in WHAT_IF.items():
        kw = dict(kw)
        if kw.get("belief") == "startup":
            kw["belief"] = startup
        for C in concurrency:
            r = simulate_arm(traces, policy, measured, C, seeds, persist=True, **kw)
            rows.append({"label": label, "policy": policy, "concurrency": C,
                         "tok_s": r["tok_s"], "ms_per_step": r["ms_per_step"],
                         "tok_per_req_step": r["tok_per_req_step"]})
    return rows


def what_if_markdown(rows: list[dict]) -> str:
    cs = sorted({r["concurrency"] for r in rows})
    by = {(r["label"], r["concurrency"]): r for r in rows}
    base = {c: by[("no_spec", c)]["tok_s"] for c in cs}
    out = ["| simulated under the measured H200 costs | "
           + " | ".join(f"C={c} tok/s (vs no spec)" for c in cs) + " |",
           "|---|" + "---|" * len(cs)]
    for label in WHAT_IF:
        cells = [f"{by[(label, c)]['tok_s']:,.0f} ({by[(label, c)]['tok_s'] / base[c]:.2f}x)"
                 for c in cs]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def measured_row(run: dict) -> dict:
    c, ph = run["concurrency"], run["phases"]
    phase_ms = sum(ph[k]["mean_ms"] for k in ("target_step", "sample_tokens", "schedule")
                   if k in ph)
    return {
        "tok_s": run["plain_tok_s"],
        "steps": run["steps"],
        "ms_per_step_plain": run["plain_ms_per_step_est"],
        "ms_per_step_phases": phase_ms,  # what the measured table charges (+ fit error)
        "tok_per_req_step": run["output_tokens"] / run["steps"] / c,
    }


def markdown(rows: list[dict]) -> str:
    """ratio = acceptance factor x step-time factor (exactly: both sides count
    steps over the makespan)."""
    head = ("| arm | C | measured tok/s (plain) | simulated, measured table | ratio | within 10% "
            "| tok/req/step meas. -> sim (factor) | ms/step plain -> sim (factor) "
            "| simulated, start-up table | ratio |")
    out = [head, "|---" * 10 + "|"]
    for r in rows:
        m, s, u = r["measured"], r["sim_measured"], r["sim_startup"]
        out.append(
            f"| {r['arm']} | {r['concurrency']} | {m['tok_s']:,.0f} | {s['tok_s']:,.0f} "
            f"| {r['ratio_measured']:.2f} | {'yes' if r['within_10pct'] else 'no'} "
            f"| {m['tok_per_req_step']:.2f} -> {s['tok_per_req_step']:.2f} "
            f"({r['acceptance_factor']:.2f}) "
            f"| {m['ms_per_step_plain']:.1f} -> {s['ms_per_step']:.1f} "
            f"({r['step_time_factor']:.2f}) "
            f"| {u['tok_s']:,.0f} | {r['ratio_startup']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, default=RESULTS)
    ap.add_argument("--startup-table", type=Path,
                    default=RESULTS / "cost_table_h200_ours_startup.json")
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "data" / "traces")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "simulator_validation.json")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    bd = load_breakdowns(args.measured)
    measured = measured_step_cost(bd)
    startup = StepCost(CostModel.from_json(args.startup_table.read_text()), K)
    found = load_traces(args.traces, ["humaneval"])
    if not found:
        raise SystemExit(f"no traces_humaneval.npz under {args.traces}")
    traces = truncated(found[0], args.output_len)
    seeds = range(args.seeds)

    rows = []
    for arm, (policy, _) in ARMS.items():
        for run in bd[arm]["runs"]:
            C = run["concurrency"]
            m = measured_row(run)
            s = simulate_arm(traces, policy, measured, C, seeds)
            u = simulate_arm(traces, policy, startup, C, seeds)
            ratio = s["tok_s"] / m["tok_s"]
            rows.append({"arm": arm, "policy": policy, "concurrency": C, "measured": m,
                         "sim_measured": s, "sim_startup": u, "ratio_measured": ratio,
                         "within_10pct": bool(abs(ratio - 1) <= 0.10),
                         "ratio_startup": u["tok_s"] / m["tok_s"],
                         # ratio = acceptance_factor * step_time_factor
                         "acceptance_factor": s["tok_per_req_step"] / m["tok_per_req_step"],
                         "step_time_factor": m["ms_per_step_plain"] / s["ms_per_step"]})
    whatif = what_if(traces, measured, startup.model, seeds)
    pts = measured_points(bd)
    fit = {
        "verify": measured.model.verify.to_dict(),
        "draft_by_depth": {d: c.to_dict() for d, c in measured.draft_curves.items()},
        "overhead_by_reqs": {k: c.to_dict() for k, c in measured.overhead_curves.items()},
        "points": {"verify": pts["verify"], "draft": pts["draft"],
                   "overhead": pts["overhead"]},
    }
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    out = {
        "command": cmd,
        "date": datetime.date.today().isoformat(),
        "elapsed_s": time.perf_counter() - t0,
        "settings": {"output_len": args.output_len, "tapes": len(traces.tapes),
                     "tape_ids": [t.prompt_id for t in traces.tapes], "seeds": args.seeds,
                     "mode": "batch (refill=False), tokens / makespan"},
        "measured_table": fit,
        "startup_table": json.loads(startup.model.to_json()),
        "rows": rows,
        "what_if": whatif,
    }
    args.out.write_text(json.dumps(out, indent=1))
    print(markdown(rows))
    print()
    print(what_if_markdown(whatif))
    print(f"\n{len(traces.tapes)} tapes of >= {args.output_len} tokens; "
          f"{out['elapsed_s']:.1f} s; wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
