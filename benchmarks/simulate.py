"""Trace-driven server simulation: throughput vs concurrency per verification policy.

Replays the labelled draft traces (../shared/data/traces) through every
policy of vllm_av.sim at each concurrency, under a step-cost table, and
reports output tokens/s, tokens/s per user and the fraction of the oracle's
throughput each policy reaches. Model and assumptions: docs/simulator.md.

    python benchmarks/simulate.py --cost h200_design
    python benchmarks/simulate.py --cost all --update-docs
    python benchmarks/simulate.py --cost-json /path/to/profiled_costs.json --K 7

Writes benchmarks/results/simulate_<cost>.json and docs/img/simulate_<cost>.png;
with --update-docs, the tables in docs/simulator.md between the
`<!-- BEGIN results:<cost> -->` markers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path

from vllm_av.core.cost_model import CostModel
from vllm_av.sim import (
    POLICY_ORDER,
    StepCost,
    TraceSet,
    h200_design,
    h200_eagle,
    large_deployment,
    load_traces,
    make_policy,
    measure_cpu_mlp,
    simulate,
)

REPO = Path(__file__).resolve().parents[1]
BUILTIN_COSTS = ("h200_design", "h200_eagle", "cpu_mlp", "large_deployment")


def _cost_model(name: str, K: int, remeasure: bool, results: Path) -> CostModel:
    if name == "h200_design":
        return h200_design(K)
    if name == "h200_eagle":
        return h200_eagle(K)
    if name == "large_deployment":
        return large_deployment(K)
    if name == "cpu_mlp":
        cache = results / "cost_cpu_mlp.json"
        if cache.exists() and not remeasure:
            return CostModel.from_json(cache.read_text())
        model = measure_cpu_mlp(K)
        cache.write_text(model.to_json())
        return model
    raise ValueError(f"unknown cost model {name!r}; choose from {BUILTIN_COSTS} or --cost-json")


def _markdown(rows: list[dict], dataset: str, concurrency: list[int]) -> str:
    """One table: policy x concurrency, cells 'tok/s (per user) fraction-of-oracle'."""
    by = {(r["policy"], r["concurrency"]): r for r in rows if r["dataset"] == dataset}
    policies = [p for p in POLICY_ORDER if any((p, c) in by for c in concurrency)]
    head = "| policy | " + " | ".join(f"C={c}" for c in concurrency) + " |"
    out = [f"**{dataset}**: output tok/s (tok/s per user), % of oracle", "", head,
           "|---" * (len(concurrency) + 1) + "|"]
    for p in policies:
        cells = []
        for c in concurrency:
            r = by.get((p, c))
            cells.append("" if r is None else
                         f"{r['throughput']:,.0f} ({r['per_user']:,.0f}) {r['frac_oracle']:.0%}")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _plot(rows, datasets, concurrency, title, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(datasets), 2, figsize=(12, 4.2 * len(datasets)), squeeze=False)
    for i, ds in enumerate(datasets):
        for p in POLICY_ORDER:
            rs = sorted((r for r in rows if r["dataset"] == ds and r["policy"] == p),
                        key=lambda r: r["concurrency"])
            if not rs:
                continue
            c = [r["concurrency"] for r in rs]
            style = "k--" if p == "oracle" else ("-o" if p.startswith("ours") else "-")
            axes[i, 0].plot(c, [r["throughput"] for r in rs], style, label=p, markersize=3)
            axes[i, 1].plot(c, [r["frac_oracle"] for r in rs], style, label=p, markersize=3)
        axes[i, 0].set(xscale="log", yscale="log", xlabel="concurrency",
                       ylabel="output tokens/s", title=f"{ds}: throughput")
        axes[i, 1].set(xscale="log", xlabel="concurrency", ylabel="fraction of oracle",
                       title=f"{ds}: fraction of the oracle", ylim=(0, 1.05))
        for ax in axes[i]:
            ax.set_xticks(concurrency, [str(c) for c in concurrency])
            ax.grid(alpha=0.3)
    axes[0, 1].legend(fontsize=8, loc="lower left")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _update_docs(doc: Path, name: str, text: str) -> None:
    begin, end = f"<!-- BEGIN results:{name} -->", f"<!-- END results:{name} -->"
    body = doc.read_text() if doc.exists() else "# Simulator\n"
    block = f"{begin}\n{text}\n{end}"
    if begin in body and end in body:
        body = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, body,
                      flags=re.S)
    else:
        body = body.rstrip() + f"\n\n### Cost model `{name}`\n\n{block}\n"
    doc.write_text(body)


def run_one(name, model, K, trace_sets, args) -> dict:
    step_cost = StepCost(model, K)
    rows = []
    t0 = time.perf_counter()
    for ts in trace_sets:
        for c in args.concurrency:
            for p in args.policies:
                r = simulate(ts, make_policy(p, ts.K, step_cost), step_cost, c,
                             max_steps=args.max_steps, warmup_steps=args.warmup, seed=args.seed)
                rows.append({"dataset": ts.name, **r.to_dict()})
    oracle = {(r["dataset"], r["concurrency"]): r["throughput"]
              for r in rows if r["policy"] == "oracle"}
    for r in rows:
        o = oracle.get((r["dataset"], r["concurrency"]))
        r["frac_oracle"] = r["throughput"] / o if o else float("nan")
    elapsed = time.perf_counter() - t0
    datasets = [ts.name for ts in trace_sets]
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    date = datetime.date.today().isoformat()
    tables = "\n\n".join(_markdown(rows, ds, args.concurrency) for ds in datasets)
    header = (f"Command: `{cmd}` ({date}, {elapsed:.0f} s on {platform.machine()}); "
              f"{args.max_steps} steps, first {args.warmup} not counted, seed {args.seed}. "
              f"Cost model ({name}): {model.summary().removeprefix('cost model: ')}.\n\n![{name}](img/simulate_{name}.png)\n")
    print(f"\n## {name}\n\n{header}\n{tables}\n")
    out = {
        "cost_model": name,
        "cost_table": json.loads(model.to_json()),
        "draft_table_depth": K,
        "command": cmd,
        "date": date,
        "elapsed_s": elapsed,
        "settings": {"max_steps": args.max_steps, "warmup_steps": args.warmup,
                     "explore_share": args.explore_share,
                     "seed": args.seed, "concurrency": args.concurrency,
                     "datasets": datasets},
        "results": rows,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"simulate_{name}.json").write_text(json.dumps(out, indent=1))
    _plot(rows, datasets, args.concurrency, f"simulated server, cost model {name}",
          args.img / f"simulate_{name}.png")
    if args.update_docs:
        _update_docs(args.doc, name, header + "\n" + tables)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cost", nargs="+", default=["h200_design"],
                    help=f"built-in cost models {BUILTIN_COSTS} or 'all'")
    ap.add_argument("--cost-json", type=Path, action="append", default=[],
                    help="a CostModel.to_json table (start-up profile); named by file stem")
    ap.add_argument("--K", type=int, default=7,
                    help="depth the draft table was profiled at (num_speculative_tokens)")
    ap.add_argument("--traces", type=Path, default=REPO.parent / "shared" / "data" / "traces")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    ap.add_argument("--policies", nargs="+", default=list(POLICY_ORDER))
    ap.add_argument("--max-steps", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--remeasure", action="store_true", help="re-time the cpu_mlp table")
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--img", type=Path, default=REPO / "docs" / "img")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "simulator.md")
    ap.add_argument("--update-docs", action="store_true")
    ap.add_argument("--explore-share", type=float,
                    help="what-if: the share of time ours' depth policy may spend exploring "
                         "(EXPLORE_MAX_TIME_SHARE in vllm_av/core/verifier.py, default 0.05)")
    args = ap.parse_args(argv)
    if args.explore_share is not None:
        import vllm_av.core.verifier as verifier

        verifier.EXPLORE_MAX_TIME_SHARE = args.explore_share
    if "oracle" not in args.policies:
        args.policies.append("oracle")  # the reference for the fractions

    trace_sets = load_traces(args.traces, args.datasets)
    if not trace_sets:
        print(f"no traces under {args.traces}; using a synthetic trace", file=sys.stderr)
        trace_sets = [TraceSet.synthetic(num_prompts=32, num_steps=40, K=args.K)]
    names = list(BUILTIN_COSTS) if "all" in args.cost else args.cost
    jobs = [(n, _cost_model(n, args.K, args.remeasure, args.results)) for n in names]
    for path in args.cost_json:
        jobs.append((path.stem, CostModel.from_json(path.read_text())))
    for name, model in jobs:
        run_one(name, model, args.K, trace_sets, args)


if __name__ == "__main__":
    main()
