"""How often the side-by-side intervals exclude 1 when the arms are
identical, with engines that keep a speed of their own (CPU, no engine).

    python benchmarks/by_engine_calibration.py \
        --out benchmarks/results/cpu_20261205_by_engine_calibration.json

Simulated sittings as the H200 showed them (an engine's speed log-normal
around its arm's, sd `engine_sd`, for its whole life; each batch around its
engine's, sd `batch_sd`), read by scripts/gpu/side_by_side.py's
`by_engine` (the engine as the unit) and by its interval over repeats
(`pooled_ratios_by_repeat`, `ratio_summary`). Seeded: the rates are
reproducible; tests/core/test_side_by_side_helpers.py asserts them.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import side_by_side  # noqa: E402


def simulated_sittings(rng, shift=1.0, engines=2, sittings=2, repeats=12, engine_sd=0.03,
                       batch_sd=0.01) -> list[dict]:
    """Sittings of `runs` ({arm: [batch, ...]}, arms nospec and ours with
    twins), ours' engines `shift` times plain's speed."""
    out = []
    for _ in range(sittings):
        runs = {}
        for arm, scale in (("nospec", 1.0), ("ours", shift)):
            for e in range(engines):
                name = arm if e == 0 else f"{arm}_twin{e}"
                speed = 1000 * scale * math.exp(rng.gauss(0, engine_sd))
                runs[name] = [{"tok_s": speed * math.exp(rng.gauss(0, batch_sd)), "repeat": r}
                              for r in range(repeats)]
        out.append(runs)
    return out


def engine_medians(runs: dict, arm: str) -> list[float]:
    return [statistics.median(r["tok_s"] for r in runs[a]) for a in runs
            if side_by_side.base_arm(a) == arm]


def by_engine_of(sittings: list[dict]) -> dict:
    return side_by_side.by_engine([(engine_medians(r, "nospec"), engine_medians(r, "ours"))
                                   for r in sittings])


def by_repeat_interval(sittings: list[dict]) -> list[float]:
    ratios = []
    for r in sittings:
        ratios += side_by_side.pooled_ratios_by_repeat(
            r, [a for a in r if a.startswith("ours")], [a for a in r if a.startswith("nospec")])
    return side_by_side.ratio_summary(ratios)["ci90"]


def engine_interval_misses(seed: int = 1, runs: int = 600) -> float:
    """Share of null runs (2 sittings of 2 engines per arm) whose by-engine
    90% interval excludes 1."""
    rng = random.Random(seed)
    misses = 0
    for _ in range(runs):
        lo, hi = by_engine_of(simulated_sittings(rng))["ci90"]
        misses += not lo <= 1 <= hi
    return misses / runs


def repeat_interval_misses(seed: int = 1, runs: int = 60, skip: int = 600) -> float:
    """The same for the interval over repeats (the generator advanced past
    `skip` by-engine runs, as the test draws them)."""
    rng = random.Random(seed)
    for _ in range(skip):
        simulated_sittings(rng)
    misses = 0
    for _ in range(runs):
        lo, hi = by_repeat_interval(simulated_sittings(rng))
        misses += not lo <= 1 <= hi
    return misses / runs


def permutation_rates(seed: int = 2, power_runs: int = 100, null_runs: int = 300) -> dict:
    """One sitting of 6 engines per arm: how often p_below < 0.05 with ours
    10% slower, then with the arms identical."""
    rng = random.Random(seed)
    hits = sum(by_engine_of(simulated_sittings(rng, shift=0.9, engines=6, sittings=1))["p_below"]
               < 0.05 for _ in range(power_runs))
    false = sum(by_engine_of(simulated_sittings(rng, engines=6, sittings=1))["p_below"] < 0.05
                for _ in range(null_runs))
    return {"gap_10pct_detected": hits / power_runs, "null_p_below_005": false / null_runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    args = p.parse_args()
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
        "command": "python benchmarks/by_engine_calibration.py",
        "setting": {"engine_sd": 0.03, "batch_sd": 0.01, "repeats": 12,
                    "null": "2 sittings x 2 engines per arm",
                    "permutation": "1 sitting x 6 engines per arm"},
        "engine_interval_excludes_1": engine_interval_misses(),
        "repeat_interval_excludes_1": repeat_interval_misses(),
        **permutation_rates(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
