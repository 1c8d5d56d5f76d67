"""`AdaptiveVerifier.admit_fetching`: the admission plus a tensor the caller
needs on the host (the drafted token ids), brought over in one transfer.
It must admit exactly what `admit` admits, learn the same, and return the
token ids exactly: the transfer goes through float64, which holds integers
below 2**53; float32 (integers below 2**24) would not. Negative control:
the same transfer through float32 corrupts the large ids and is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vllm_av.core.verifier as verifier_mod
from vllm_av.core.cost_model import CostModel
from vllm_av.core.verifier import AdaptiveVerifier

K, R = 5, 12


def _verifier() -> AdaptiveVerifier:
    # Verification grows past R tokens: the budget trims.
    cost = CostModel.from_samples({1: [1.0], R: [1.0], 8 * R: [8.0]}, {1: [0.0]})
    return AdaptiveVerifier(K, cost)


def _steps(fetching: bool, steps: int = 6):
    torch.manual_seed(0)
    v, ids = _verifier(), [f"r{i}" for i in range(R)]
    admitted_log, fetched_log, drafts_log = [], [], []
    for _ in range(steps):
        feats = torch.randn(R, K) * 2 + 1
        drafts = torch.randint(0, 2**40, (R, K))  # ids far past float32's exact range
        drafted = np.full(R, K)
        if fetching:
            admitted, fetched = v.admit_fetching(ids, feats, drafted, R, R, fetch=drafts)
            fetched_log.append(fetched)
        else:
            admitted = v.admit(ids, feats, drafted, R, R)
        drafts_log.append(drafts.numpy())
        admitted_log.append(admitted)
        v.begin_step()
        v.observe(ids, admitted, np.minimum(admitted, 1))
    return admitted_log, fetched_log, drafts_log, v.estimator.coefficients


def test_admit_fetching_admits_and_learns_as_admit_and_returns_the_ids_exactly():
    plain_admitted, _, _, plain_coef = _steps(fetching=False)
    admitted, fetched, drafts, coef = _steps(fetching=True)
    assert all(np.array_equal(a, b) for a, b in zip(admitted, plain_admitted))
    assert any(a.sum() < R * K for a in admitted)  # the budget did trim
    assert torch.equal(coef, plain_coef)
    for got, want in zip(fetched, drafts):
        assert got.dtype == np.int64 and got.shape == want.shape
        assert np.array_equal(got, want)


def test_a_float_fetch_is_refused():
    v = _verifier()
    with pytest.raises(TypeError, match="integer tensor"):
        v.admit_fetching([f"r{i}" for i in range(R)], torch.randn(R, K), np.full(R, K), R, R,
                         fetch=torch.rand(R, K))


def test_negative_control_a_float32_transfer_corrupts_the_ids(monkeypatch):
    """The same single transfer in float32: the check above would fail."""

    def float32_together(admitted, stacked, fetch):
        host = torch.cat([p.reshape(-1).float() for p in (admitted, stacked, fetch)]).numpy()
        n_a, n_s = admitted.numel(), stacked.numel()
        surv, conf = host[n_a:n_a + n_s].reshape(stacked.shape)
        return (host[:n_a].astype(np.int64), surv, conf,
                host[n_a + n_s:].astype(np.int64).reshape(tuple(fetch.shape)))

    monkeypatch.setattr(verifier_mod, "_fetch_together", float32_together)
    _, fetched, drafts, _ = _steps(fetching=True, steps=1)
    assert not np.array_equal(fetched[0], drafts[0])
