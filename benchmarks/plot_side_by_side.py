"""PNG plot of a side-by-side run (scripts/gpu/side_by_side.py): each arm's
paired tokens/s over the first arm against concurrency, the median of the
repeats with their min-max range as a bar. The line at 1 is the first arm
(usually no speculation); a bar that crosses it ranks nothing. Given a
pooled JSON (`side_by_side.py --pool ... --out pooled.json`) it plots each
group's ratio with the engine as the unit and its 90% t interval instead.

    python benchmarks/plot_side_by_side.py <run>/side_by_side.json [out.png]
    python benchmarks/plot_side_by_side.py <run>/pooled.json [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ratio_series(result: dict) -> tuple[str, dict[str, list[tuple[int, float, float, float]]]]:
    """(first arm, arm -> [(C, median, min, max)] by concurrency) from a
    side-by-side result."""
    by_c = {int(c): v["summary"] for c, v in result["by_concurrency"].items() if "summary" in v}
    arms = list(result["arms"])
    base = arms[0]
    key = f"tok_s_over_{base}"
    series: dict[str, list] = {}
    for c in sorted(by_c):
        for arm in arms[1:]:
            s = by_c[c].get(arm, {}).get(key)
            if s:
                series.setdefault(arm, []).append((c, s["median"], s["min"], s["max"]))
    return base, series


def engine_series(pooled: dict) -> tuple[str, dict[str, list[tuple[int, float, float, float]]]]:
    """(base group, group -> [(C, ratio, lower, upper)] by concurrency) from
    a pooled result: each group's ratio over the base with the engine as
    the unit, and its 90% t interval."""
    series: dict[str, list] = {}
    bases = set()
    for c in sorted(pooled["by_concurrency"], key=int):
        for key, row in pooled["by_concurrency"][c].items():
            if not key.endswith("_by_engine"):
                continue
            group, base = key[: -len("_by_engine")].split("_over_")
            bases.add(base)
            series.setdefault(group, []).append((int(c), row["ratio"], *row["ci90"]))
    return "/".join(sorted(bases)) or "?", series


def run_names(sittings: list[str], folder: Path) -> list[str]:
    """Each pooled run's folder name. `side_by_side.py --pool` keeps the
    paths as given, relative to where it ran: the pooled JSON's folder, by
    the results' READMEs, so a bare `side_by_side.json` is that folder's."""
    return [(folder / p).resolve().parent.name for p in sittings]


def plot(result: dict, out: Path, folder: Path = Path(".")) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = "sittings" in result
    base, series = engine_series(result) if pooled else ratio_series(result)
    fig, ax = plt.subplots(figsize=(8, 5))
    n = max(len(series), 1)
    for i, (arm, pts) in enumerate(series.items()):
        # Arms side by side around each concurrency, so the bars do not overlap.
        shift = 2 ** ((i - (n - 1) / 2) * 0.08)
        cs = [p[0] * shift for p in pts]
        med = [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        ax.errorbar(cs, med, yerr=err, marker="o", capsize=4, linewidth=1.8, label=arm)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xscale("log", base=2)
    concurrencies = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent requests")
    if pooled:
        ax.set_ylabel(f"tokens/s over {base} (by engine; 90% t interval)")
        ax.set_title(f"{len(result['sittings'])} run(s): "
                     + ", ".join(run_names(result["sittings"], folder))[:90])
    else:
        ax.set_ylabel(f"tokens/s over {base} (paired; median, min-max)")
        # A summary rebuilt from a cut-off run's log counts full repeats per C.
        per_c = {c: v["repeats"] for c, v in result["by_concurrency"].items() if "repeats" in v}
        repeats = (", ".join(f"C={c}: {n}" for c, n in per_c.items()) if per_c
                   else result.get("repeats", "?"))
        ax.set_title(f"{result.get('machine', {}).get('device', '')}, "
                     f"{repeats} repeats, {result.get('date', '')}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    if len(sys.argv) not in (2, 3) or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    path = Path(sys.argv[1])
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (a side_by_side.py --out JSON)")
    out = Path(sys.argv[2]) if len(sys.argv) == 3 else path.with_name("ratios.png")
    print(plot(json.loads(path.read_text()), out, folder=path.parent))


if __name__ == "__main__":
    main()
