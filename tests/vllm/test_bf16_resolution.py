"""The GPU distribution test also runs in bfloat16 against the float32
target distribution (tests/gpu/test_gpu_lossless.py). That is sound only
while the rounding moves the distribution by less than the test can see at
N samples: its noncentrality N * sum((q - p)^2 / p) must stay small, so the
test's false-positive rate stays near ALPHA. Computed here with
transformers on the CPU for the same tiny pair and prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from test_lossless_cpu import ALPHA, LONG_PROMPT, NUM_SAMPLES, NUM_TOKENS, PROMPT  # noqa: E402
from tiny_models import first_tokens_distribution  # noqa: E402

# The false-positive rate per chi-square test the GPU test's docstring states.
MAX_FALSE_POSITIVE_RATE = 5e-5


def _noncentrality(p: np.ndarray, q: np.ndarray) -> float:
    p, q = p.ravel(), q.ravel()
    keep = p > 0
    return float(NUM_SAMPLES * np.sum((q[keep] - p[keep]) ** 2 / p[keep]))


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["prompt", "long_prompt"])
def test_bfloat16_rounding_is_below_the_distribution_tests_resolution(tiny_models, prompt):
    exact = first_tokens_distribution(tiny_models.target, prompt, NUM_TOKENS).numpy()
    rounded = first_tokens_distribution(
        tiny_models.target, prompt, NUM_TOKENS, dtype=torch.bfloat16).numpy()
    vocab = exact.shape[0]
    marginals = {"token1": (1, 2), "token2": (0, 2), "token3": (0, 1)}
    lam = {name: _noncentrality(exact.sum(ax), rounded.sum(ax)) for name, ax in marginals.items()}
    lam["joint12"] = _noncentrality(exact.sum(2), rounded.sum(2))
    dfs = {"token1": vocab - 1, "token2": vocab - 1, "token3": vocab - 1,
           "joint12": vocab * vocab - 1}
    fpr = {k: float(scipy_stats.ncx2.sf(scipy_stats.chi2.isf(ALPHA, dfs[k]), dfs[k], lam[k]))
           for k in lam}
    print(f"bfloat16 noncentrality {lam}; false-positive rates {fpr}")
    assert max(fpr.values()) <= MAX_FALSE_POSITIVE_RATE, (lam, fpr)
    # The rounding is real (a float32 'bfloat16' run would show zero).
    assert min(lam.values()) > 0
