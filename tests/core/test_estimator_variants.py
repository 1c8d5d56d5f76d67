"""AccumulatedPrecisionEstimator: same model as the default, step rule with a
running precision (vllm_av/core/estimator_variants.py)."""

import math

import pytest
import torch

from vllm_av.core.estimator_variants import AccumulatedPrecisionEstimator

K = 4


def _stream(theta, steps, batch, seed=0):
    """Synthetic steps: features ~ N(1, 2), acceptance per DESIGN 2.1's model."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        f = torch.randn(batch, K, generator=g) * 2 + 1
        p = torch.sigmoid(theta[0] * f + theta[1:])
        ok = torch.rand(batch, K, generator=g) < p
        n_acc = torch.cumprod(ok.long(), dim=1).sum(1)
        yield f, torch.full((batch,), K), n_acc


def test_converges_to_true_coefficients_at_batch_one():
    theta = torch.tensor([0.6, 0.7, 0.8, 1.0, 1.2])
    est = AccumulatedPrecisionEstimator(K)
    for f, adm, acc in _stream(theta, 4000, 1):
        est.observe(f, adm, acc)
    assert est.slope == pytest.approx(0.6, abs=0.1)
    assert est.intercepts[0] == pytest.approx(0.7, abs=0.2)


def test_prior_survival_is_cumprod_of_observed_rates():
    est = AccumulatedPrecisionEstimator(K, refit_interval=1000)
    f = torch.zeros(2, K)
    # Request 0 accepts 2 then is rejected at slot 2; request 1 is rejected at slot 0.
    est.observe(f, torch.tensor([K, K]), torch.tensor([2, 0]))
    s = est.prior_survival()
    assert s[0].item() == pytest.approx(0.5)  # slot 0: 1 of 2 accepted
    assert s[1].item() == pytest.approx(0.5 * 1.0)  # slot 1: 1 of 1
    assert s[2].item() == pytest.approx(0.0)  # slot 2: 0 of 1


def test_per_position_prior_intercepts_and_bad_windows():
    est = AccumulatedPrecisionEstimator(K, intercept=[0.1, 0.2, 0.3, 0.4], slope=0.5)
    assert est.intercepts == pytest.approx([0.1, 0.2, 0.3, 0.4])
    est.observe(torch.full((2, K), math.nan), torch.tensor([K, K]), torch.tensor([K, 1]))
    est.refit()
    assert torch.isfinite(est.coefficients).all()
    with pytest.raises(ValueError, match="intercept needs"):
        AccumulatedPrecisionEstimator(K, intercept=[0.0, 1.0])
