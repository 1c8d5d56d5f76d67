"""PNG plots of a sweep summary (benchmarks/sweep.py merge): the Pareto view and throughput.

pareto[_greedy].png: output throughput against tokens/s per user, one line
per arm through its concurrencies (each point labelled with C). Up and to
the right is better; an arm on the frontier at a concurrency is one no
other arm beats in both.

throughput[_greedy].png: output throughput and tokens/s per user against
concurrency (log-2 axis), one line per arm.

    python benchmarks/plot_sweep.py benchmarks/results/sweep/<run>/summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Our arms stand out; baselines are thinner, fixed K in one colour ramp.
_OURS_STYLE = {"linewidth": 2.6, "marker": "o", "markersize": 6, "zorder": 5}
_BASE_STYLE = {"linewidth": 1.3, "marker": ".", "markersize": 6}


def _style(row: dict) -> dict:
    style = dict(_OURS_STYLE if row.get("role") == "ours" else _BASE_STYLE)
    if row.get("family") == "ngram":
        style["linestyle"] = "--"
    if row.get("role") == "nospec":
        style["color"] = "black"
    return style


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["arm"], []).append(r)
    return {a: sorted(rs, key=lambda r: r["concurrency"]) for a, rs in by.items()}


def plot_summary(summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rows = summary["rows"]
    for pass_name in sorted({r["pass"] for r in rows}):
        rs = [r for r in rows if r["pass"] == pass_name and r.get("output_throughput")]
        if not rs:
            continue
        suffix = "" if pass_name == "t1" else f"_{pass_name}"
        series = _series(rs)

        fig, ax = plt.subplots(figsize=(8, 6))
        for arm, pts in series.items():
            pts = [p for p in pts if p.get("tps_user")]
            if not pts:
                continue
            line, = ax.plot([p["tps_user"] for p in pts], [p["output_throughput"] for p in pts],
                            label=arm, **_style(pts[0]))
            for p in pts:
                ax.annotate(str(p["concurrency"]), (p["tps_user"], p["output_throughput"]),
                            textcoords="offset points", xytext=(3, 3), fontsize=7,
                            color=line.get_color())
        ax.set(xscale="log", yscale="log", xlabel="tokens/s per user (1000 / mean TPOT)",
               ylabel="output tokens/s", title=f"throughput vs interactivity ({pass_name}); "
                                               "labels: concurrency")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out_dir) / f"pareto{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        conc = sorted({r["concurrency"] for r in rs})
        for arm, pts in series.items():
            c = [p["concurrency"] for p in pts]
            axes[0].plot(c, [p["output_throughput"] for p in pts], label=arm, **_style(pts[0]))
            axes[1].plot(c, [p.get("tps_user") or float("nan") for p in pts], label=arm,
                         **_style(pts[0]))
        axes[0].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="output tokens/s",
                    title=f"output throughput ({pass_name})")
        axes[1].set(xscale="log", yscale="log", xlabel="concurrency",
                    ylabel="tokens/s per user", title=f"tokens/s per user ({pass_name})")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(conc, [str(c) for c in conc])
            ax.grid(alpha=0.3, which="both")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = Path(out_dir) / f"throughput{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    summary_path = Path(sys.argv[1])
    for p in plot_summary(json.loads(summary_path.read_text()), summary_path.parent):
        print(p)
