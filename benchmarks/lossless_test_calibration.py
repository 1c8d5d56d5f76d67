"""False-positive rate of the distribution tests, by simulation.

tests/vllm/test_lossless_cpu.py checks four chi-square p-values (tokens 1,
2, 3 and the joint of 1-2) against ALPHA, with cells expected below 5
pooled. The p-values come from the chi-square approximation; this draws
`--reps` samples of the test's size straight from the exact distribution
of the tiny pair (a lossless engine at its best) and counts how often each
check, and any of the four, falls below a few levels. One multinomial draw
over the V^3 joint per repetition, so the counts are exact samples of N.

    python benchmarks/lossless_test_calibration.py --reps 20000 \\
        --out benchmarks/results/lossless_test_calibration_cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))
sys.path.insert(0, str(REPO))

LEVELS = (1e-2, 1e-3, 1e-4, 1e-5)


def tokens_of(joint: np.ndarray) -> np.ndarray:
    """[N, 3] samples (token1, token2, token3) from [V, V, V] counts, the
    form the test's p_values reads."""
    cells = np.repeat(np.arange(joint.size), joint.ravel())
    return np.stack(np.unravel_index(cells, joint.shape), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from test_lossless_cpu import ALPHA, NUM_SAMPLES, NUM_TOKENS, PROMPT, p_values
    from tiny_models import build_tiny_models, first_tokens_distribution

    models = build_tiny_models(Path(tempfile.mkdtemp(prefix="calib_models")))
    exact = first_tokens_distribution(models.target, PROMPT, NUM_TOKENS).numpy()
    flat = exact.ravel() / exact.sum()
    rng = np.random.default_rng(args.seed)
    names = ("token1", "token2", "token3", "joint12")
    pvals = {name: np.empty(args.reps) for name in names}
    start = time.time()
    for r in range(args.reps):
        joint = rng.multinomial(NUM_SAMPLES, flat).reshape(exact.shape)
        for name, p in p_values(tokens_of(joint), exact).items():
            pvals[name][r] = p
        if (r + 1) % max(1, args.reps // 10) == 0:
            print(f"{r + 1}/{args.reps} repetitions, {time.time() - start:.0f} s", flush=True)
    any_min = np.minimum.reduce([pvals[n] for n in names])
    rates = {
        str(level): {
            **{n: float((pvals[n] < level).mean()) for n in names},
            "any_of_four": float((any_min < level).mean()),
        }
        for level in LEVELS
    }
    result = {
        "what": "fraction of exact-distribution draws whose p-value falls below each level",
        "num_samples": NUM_SAMPLES, "alpha": ALPHA, "reps": args.reps, "seed": args.seed,
        "rates": rates, "seconds": round(time.time() - start, 1),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
