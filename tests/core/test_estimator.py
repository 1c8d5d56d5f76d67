import math

import pytest
import torch

from vllm_av.core.estimator import COEF_CLIP, OnlineAcceptanceEstimator

K = 5


def _simulate_step(g, w, b, R, num_admitted=None):
    """Features and outcomes from p_i = sigmoid(w f_i + b_i), censored at the
    first rejection, as verification would produce them."""
    f = torch.randn(R, K, generator=g) * 2 + 1
    p = torch.sigmoid(w * f + torch.tensor(b))
    acc = torch.rand(R, K, generator=g) < p
    if num_admitted is None:
        num_admitted = torch.randint(0, K + 1, (R,), generator=g)
    pos = torch.arange(K)
    acc &= pos < num_admitted.unsqueeze(1)
    num_accepted = torch.cumprod(acc.long(), 1).sum(1)
    return f, num_admitted, num_accepted


def test_estimator_learns_known_synthetic_coefficients():
    g = torch.Generator().manual_seed(0)
    w, b = 0.6, [1.5, 0.8, 0.3, -0.2, -0.6]
    est = OnlineAcceptanceEstimator(K)
    for _ in range(400):
        est.observe(*_simulate_step(g, w, b, 64))
    assert abs(est.slope - w) < 0.06
    assert max(abs(x - y) for x, y in zip(est.intercepts, b)) < 0.25


def test_labels_follow_first_rejection_censoring():
    est = OnlineAcceptanceEstimator(4, refit_interval=10**6)
    f = torch.zeros(3, 4)
    # Row 0: 4 admitted, 2 accepted -> pos 0,1 = 1, pos 2 = 0, pos 3 unlabelled.
    # Row 1: 2 admitted, 2 accepted -> pos 0,1 = 1, nothing else (trimmed).
    # Row 2: 0 admitted -> no labels at all.
    est.observe(f, torch.tensor([4, 2, 0]), torch.tensor([2, 2, 0]))
    st = est.statistics()
    # With f = 0 and prior intercepts 0, p = 0.5 everywhere: each label adds
    # y - 0.5 to its intercept's gradient and 0.25 to its curvature.
    torch.testing.assert_close(st["count"][1:], torch.tensor([2.0, 2.0, 1.0, 0.0], dtype=torch.float64))
    assert st["count"][0].item() == 5
    torch.testing.assert_close(st["gradient"][1:], torch.tensor([1.0, 1.0, -0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(
        torch.diagonal(st["hessian"])[1:], torch.tensor([0.5, 0.5, 0.25, 0.0], dtype=torch.float64)
    )


def test_refit_happens_every_interval_and_clears_statistics():
    est = OnlineAcceptanceEstimator(3, refit_interval=4)
    f = torch.ones(8, 3)
    before = est.coefficients
    for step in range(1, 9):
        est.observe(f, torch.full((8,), 3), torch.full((8,), 1))
        if step % 4:
            assert est.statistics()["count"][0].item() > 0
            assert est.num_refits == step // 4
        else:
            assert est.statistics()["count"].abs().sum().item() == 0
            assert est.num_refits == step // 4
    assert not torch.equal(before, est.coefficients)


@pytest.mark.parametrize(
    "case",
    ["nothing_verified", "everything_accepted", "huge_features", "nan_features", "position_never_seen"],
)
def test_degenerate_rounds_never_produce_nan_or_inf(case):
    est = OnlineAcceptanceEstimator(K, refit_interval=1)
    R = 16
    for i in range(50):
        f = torch.randn(R, K)
        n_adm = torch.full((R,), K)
        n_acc = torch.randint(0, K + 1, (R,))
        if case == "nothing_verified":
            n_adm = torch.zeros(R, dtype=torch.long)
        elif case == "everything_accepted":
            n_acc = n_adm.clone()
        elif case == "huge_features":
            f = torch.where(torch.rand(R, K) < 0.5, 1e6, -1e6)
        elif case == "nan_features":
            f[0, 0] = float("nan")
            f[1, 1] = float("inf")
        elif case == "position_never_seen":
            n_adm = torch.full((R,), 2)
            n_acc = torch.minimum(n_acc, n_adm)
        est.observe(f, n_adm, n_acc)
        coef = est.coefficients
        assert torch.isfinite(coef).all(), (case, i, coef)
        assert coef.abs().max() <= COEF_CLIP
    assert torch.isfinite(est.predict(torch.randn(4, K) * 1e6)).all()
    assert torch.isfinite(est.prior_survival()).all()


def test_prior_is_q_max_before_any_observation():
    est = OnlineAcceptanceEstimator(3)
    q = torch.tensor([[0.3, 0.9, 0.99]])
    f = torch.log(q / (1 - q))
    torch.testing.assert_close(est.predict(f), q)
    assert est.slope == 1.0 and est.intercepts == [0.0, 0.0, 0.0]


def test_prior_survival_is_non_increasing_and_tracks_observed_acceptance():
    g = torch.Generator().manual_seed(1)
    est = OnlineAcceptanceEstimator(K)
    prior0 = est.prior_survival()
    assert prior0.shape == (K,) and torch.all(prior0[1:] <= prior0[:-1])
    for _ in range(200):
        est.observe(*_simulate_step(g, 0.0, [-3.0] * K, 32, torch.full((32,), K)))
    # Acceptance ~5% per position: the prior for a new request must drop.
    assert est.prior_survival()[0].item() < 0.15 < prior0[0].item()


def test_predict_accepts_fewer_positions_than_fitted():
    est = OnlineAcceptanceEstimator(K)
    assert est.predict(torch.zeros(2, 3)).shape == (2, 3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        est.predict(torch.zeros(2, K + 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_estimator_runs_on_cuda_tensors():
    g = torch.Generator().manual_seed(0)
    est = OnlineAcceptanceEstimator(K, device="cuda")
    for _ in range(40):
        f, a, n = _simulate_step(g, 0.6, [1.0, 0.5, 0.0, -0.5, -1.0], 64)
        est.observe(f.cuda(), a.cuda(), n.cuda())
    assert est.predict(f.cuda()).device.type == "cuda"
    assert math.isfinite(est.slope)
