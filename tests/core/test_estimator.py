import math

import pytest
import torch

from vllm_av.core.estimator import (
    COEF_CLIP,
    DEFAULT_DAMPING,
    DEFAULT_MEMORY,
    OnlineAcceptanceEstimator,
)

K = 5
# The default step rule (running precision) and the reference one (memory=0:
# each window alone, damped by n / (n + c)); both must keep the contract.
MODES = [pytest.param(DEFAULT_MEMORY, id="precision"), pytest.param(0.0, id="plain")]


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


@pytest.mark.parametrize("memory", MODES)
def test_estimator_learns_known_synthetic_coefficients(memory):
    g = torch.Generator().manual_seed(0)
    w, b = 0.6, [1.5, 0.8, 0.3, -0.2, -0.6]
    est = OnlineAcceptanceEstimator(K, memory=memory)
    for _ in range(400):
        est.observe(*_simulate_step(g, w, b, 64))
    assert abs(est.slope - w) < 0.06
    assert max(abs(x - y) for x, y in zip(est.intercepts, b)) < 0.25


def test_default_converges_at_batch_one():
    # Batch 1 is where the plain damped step jitters (25-40 labels a window);
    # the running precision must still settle near the truth.
    g = torch.Generator().manual_seed(0)
    w, b = 0.6, [0.7, 0.8, 1.0, 1.2, 1.4]
    est = OnlineAcceptanceEstimator(K)
    for _ in range(4000):
        est.observe(*_simulate_step(g, w, b, 1, torch.tensor([K])))
    assert est.slope == pytest.approx(w, abs=0.1)
    assert est.intercepts[0] == pytest.approx(b[0], abs=0.2)


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
    f64 = dict(dtype=torch.float64)
    torch.testing.assert_close(st["count"][1:], torch.tensor([2.0, 2.0, 1.0, 0.0], **f64))
    assert st["count"][0].item() == 5
    torch.testing.assert_close(st["accepted"], torch.tensor([2.0, 2.0, 0.0, 0.0], **f64))
    torch.testing.assert_close(st["gradient"][1:], torch.tensor([1.0, 1.0, -0.5, 0.0], **f64))
    torch.testing.assert_close(
        torch.diagonal(st["hessian"])[1:], torch.tensor([0.5, 0.5, 0.25, 0.0], **f64)
    )


@pytest.mark.parametrize("memory", MODES)
def test_refit_happens_every_interval_and_clears_window_statistics(memory):
    est = OnlineAcceptanceEstimator(3, refit_interval=4, memory=memory)
    f = torch.ones(8, 3)
    before = est.coefficients
    for step in range(1, 9):
        est.observe(f, torch.full((8,), 3), torch.full((8,), 1))
        assert est.num_refits == step // 4
        if step % 4:
            assert est.statistics()["count"][0].item() > 0
        else:
            st = est.statistics()
            for key in ("hessian", "gradient", "count", "accepted"):
                assert st[key].abs().sum().item() == 0, key
            # The running precision is separate state: kept (memory > 0) or
            # never used (memory 0).
            assert (st["precision"].abs().sum().item() > 0) == (memory > 0)
    assert not torch.equal(before, est.coefficients)


def _window(est, g, R=6):
    f, adm, acc = _simulate_step(g, 0.8, [1.0, 0.5, 0.0, -0.5, -1.0], R, torch.full((R,), K))
    est.observe(f, adm, acc)
    return est.statistics()


@pytest.mark.parametrize(
    "memory,damping",
    [(0.0, None), (0.0, 10.0), (50.0, None), (50.0, 20.0)],
    ids=["plain", "plain-damping10", "precision", "precision-damping20"],
)
def test_newton_step_follows_the_documented_rule(memory, damping):
    # Two windows, so the precision rule's forgetting and the damping counts
    # are exercised; the expected step is recomputed from the statistics.
    g = torch.Generator().manual_seed(3)
    est = OnlineAcceptanceEstimator(K, refit_interval=10**6, memory=memory, damping=damping,
                                    max_step=math.inf)
    c = (DEFAULT_DAMPING if memory == 0 else 0.0) if damping is None else damping
    eye = torch.eye(K + 1, dtype=torch.float64)
    precision = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    label_n = torch.zeros(K, dtype=torch.float64)
    for _ in range(2):
        st = _window(est, g)
        theta = est.coefficients.double()
        if memory > 0:
            forget = math.exp(-st["count"][0].item() / memory)
            precision = forget * precision + st["hessian"]
            label_n = forget * label_n + st["count"][1:]
            behind = torch.cat([label_n.sum().reshape(1), label_n])
            delta = torch.linalg.solve(precision + eye, st["gradient"])
        else:
            behind = st["count"]
            delta = torch.linalg.solve(st["hessian"] + eye, st["gradient"])
        if c > 0:
            delta = delta * behind / (behind + c)
        est.refit()
        torch.testing.assert_close(est.coefficients.double(), theta + delta, rtol=1e-5, atol=1e-5)
        if memory > 0:
            torch.testing.assert_close(est.statistics()["precision"], precision)


@pytest.mark.parametrize("memory", MODES)
@pytest.mark.parametrize(
    "case",
    ["nothing_verified", "everything_accepted", "huge_features", "nan_features", "position_never_seen"],
)
def test_degenerate_rounds_never_produce_nan_or_inf(case, memory):
    est = OnlineAcceptanceEstimator(K, refit_interval=1, memory=memory)
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
        assert torch.isfinite(est.statistics()["precision"]).all()
    assert torch.isfinite(est.predict(torch.randn(4, K) * 1e6)).all()
    prior = est.prior_survival()
    assert torch.isfinite(prior).all() and prior.min() >= 0 and prior.max() <= 1


def test_prior_is_q_max_before_any_observation():
    est = OnlineAcceptanceEstimator(3)
    q = torch.tensor([[0.3, 0.9, 0.99]])
    f = torch.log(q / (1 - q))
    torch.testing.assert_close(est.predict(f), q)
    assert est.slope == 1.0 and est.intercepts == [0.0, 0.0, 0.0]


def test_per_position_prior_intercepts():
    est = OnlineAcceptanceEstimator(4, intercept=[0.1, 0.2, 0.3, 0.4], slope=0.5)
    assert est.slope == 0.5 and est.intercepts == pytest.approx([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match="intercept needs"):
        OnlineAcceptanceEstimator(4, intercept=[0.0, 1.0])
    with pytest.raises(ValueError, match="memory"):
        OnlineAcceptanceEstimator(4, memory=-1.0)


def test_prior_survival_is_non_increasing_and_tracks_observed_acceptance():
    g = torch.Generator().manual_seed(1)
    est = OnlineAcceptanceEstimator(K)
    prior0 = est.prior_survival()
    assert prior0.shape == (K,) and torch.all(prior0[1:] <= prior0[:-1])
    for _ in range(200):
        est.observe(*_simulate_step(g, 0.0, [-3.0] * K, 32, torch.full((32,), K)))
    # Acceptance ~5% per position: the prior for a new request must drop.
    assert est.prior_survival()[0].item() < 0.15 < prior0[0].item()


def test_prior_survival_is_cumprod_of_observed_rates():
    est = OnlineAcceptanceEstimator(K, refit_interval=1000)
    f = torch.zeros(2, K)
    # Request 0 accepts 2 then is rejected at slot 2; request 1 is rejected at slot 0.
    est.observe(f, torch.tensor([K, K]), torch.tensor([2, 0]))
    s = est.prior_survival()
    assert s[0].item() == pytest.approx(0.5)  # slot 0: 1 of 2 accepted
    assert s[1].item() == pytest.approx(0.5 * 1.0)  # slot 1: 1 of 1
    assert s[2].item() == pytest.approx(0.0)  # slot 2: 0 of 1


@pytest.mark.parametrize("memory", [10.0, 0.0], ids=["memory10", "plain"])
def test_prior_survival_rates_are_forgotten_like_the_precision(memory):
    est = OnlineAcceptanceEstimator(1, refit_interval=1, memory=memory)
    f = torch.zeros(10, 1)
    est.observe(f, torch.ones(10), torch.ones(10))  # 10 labels, all accepted
    est.observe(f, torch.ones(10), torch.zeros(10))  # 10 labels, all rejected
    # At the second refit the first window's weight is exp(-10 / memory); the
    # plain rule (memory 0) keeps the rates over DEFAULT_MEMORY labels.
    old = math.exp(-10 / (memory or DEFAULT_MEMORY))
    assert est.prior_survival()[0].item() == pytest.approx(old / (old + 1), rel=1e-5)


def test_prior_survival_falls_back_to_the_model_where_no_labels():
    est = OnlineAcceptanceEstimator(K, refit_interval=1, slope=0.5, intercept=-0.3)
    f = torch.full((4, K), 3.0)
    est.observe(f, torch.full((4,), 2), torch.full((4,), 2))  # labels at slots 0-1 only
    s = est.prior_survival()
    assert s[0].item() == pytest.approx(1.0) and s[1].item() == pytest.approx(1.0)
    model = est.predict(est.mean_features.unsqueeze(0))[0]
    torch.testing.assert_close(s[2:], torch.cumprod(model[2:], 0))
    assert est.mean_features[:2].tolist() == [3.0, 3.0]


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


def test_prior_survival_is_recomputed_whenever_the_statistics_change():
    """prior_survival is remembered between steps that change nothing; any
    observe or refit must show in the next call, exactly as a fresh
    computation would give it. Negative control: an estimator whose memo
    is never cleared serves a stale prior and is caught."""
    from vllm_av.core.estimator import OnlineAcceptanceEstimator

    def drive(est, clear: bool):
        torch.manual_seed(0)
        seen = []
        for step in range(12):
            seen.append(est.prior_survival(4))
            f = torch.randn(8, 4)
            adm = torch.full((8,), 4)
            acc = torch.randint(0, 5, (8,))
            if not clear:
                memo = dict(est._prior_memo)
            est.observe(f, adm, acc)
            if not clear:
                est._prior_memo.update(memo)
        return seen

    est = OnlineAcceptanceEstimator(4, refit_interval=3)
    memo = drive(est, clear=True)
    fresh = []
    est2 = OnlineAcceptanceEstimator(4, refit_interval=3)
    torch.manual_seed(0)
    for step in range(12):
        est2._prior_memo.clear()
        fresh.append(est2.prior_survival(4))
        est2.observe(torch.randn(8, 4), torch.full((8,), 4), torch.randint(0, 5, (8,)))
    for a, b in zip(memo, fresh):
        assert torch.equal(a, b)
    assert not torch.equal(memo[0], memo[-1])  # the prior did move
    stale = drive(OnlineAcceptanceEstimator(4, refit_interval=3), clear=False)
    assert any(not torch.equal(a, b) for a, b in zip(stale, fresh))
    # The returned tensor is the caller's: writing to it leaves the memo alone.
    p = est.prior_survival(4)
    p.fill_(0.0)
    assert est.prior_survival(4).sum() > 0


def test_slope_and_intercepts_read_the_device_once_per_refit(monkeypatch):
    """The metrics snapshot reads slope and intercepts every few steps; on a
    GPU each device read waits for the queue. They are read from the device
    once after each refit and match the coefficients at every step.
    Negative control: a cache that a refit does not clear serves the old
    coefficients and is caught."""
    reads = []
    tolist = torch.Tensor.tolist

    def counted(self):
        reads.append(self.shape)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    torch.manual_seed(0)

    def drive(est, keep_stale: bool):
        wrong = 0
        for step in range(12):
            for _ in range(3):  # several snapshots between observations
                if est.slope != est.coefficients[0].item():
                    wrong += 1
                assert len(est.intercepts) == 4
            stale = est._theta_host
            est.observe(torch.randn(8, 4), torch.full((8,), 4), torch.randint(0, 5, (8,)))
            if keep_stale:
                est._theta_host = stale
        return wrong

    est = OnlineAcceptanceEstimator(4, refit_interval=3)
    assert drive(est, keep_stale=False) == 0
    assert est.num_refits == 4
    # One read before the first refit and one after each refit that a read
    # follows (the 12th observation refits last, and nothing reads after it).
    assert len(reads) == est.num_refits
    assert drive(OnlineAcceptanceEstimator(4, refit_interval=3), keep_stale=True) > 0


def test_window_statistics_equal_the_log_likelihood_derivatives():
    """Gradient and negative Hessian of the window's censored Bernoulli
    log-likelihood in theta = [w, b_0..b_{K-1}], computed slot by slot from
    `predict` in the test, against what `observe` accumulated (per position,
    in one tensor). Negative control: the same sums over every verified
    slot instead of the labelled ones (no censoring after the first
    rejection) differ."""
    g = torch.Generator().manual_seed(5)
    est = OnlineAcceptanceEstimator(K, refit_interval=10**6)
    grad = torch.zeros(K + 1, dtype=torch.float64)
    hess = torch.zeros(K + 1, K + 1, dtype=torch.float64)
    unmasked = torch.zeros(K + 1, dtype=torch.float64)
    for _ in range(3):
        R = 9
        f = torch.randn(R, K, generator=g) * 2
        adm = torch.randint(0, K + 1, (R,), generator=g)
        acc = torch.minimum(torch.randint(0, K + 1, (R,), generator=g), adm)
        p = est.predict(f).double()
        for r in range(R):
            for j in range(int(adm[r])):
                x = torch.zeros(K + 1, dtype=torch.float64)
                x[0], x[1 + j] = float(f[r, j]), 1.0
                y = 1.0 if j < acc[r] else 0.0
                unmasked += (y - p[r, j]) * x
                if j <= acc[r]:  # accepted, or the first rejection
                    grad += (y - p[r, j]) * x
                    hess += p[r, j] * (1 - p[r, j]) * torch.outer(x, x)
        est.observe(f, adm, acc)
    st = est.statistics()
    torch.testing.assert_close(st["gradient"], grad)
    torch.testing.assert_close(st["hessian"], hess)
    assert not torch.allclose(st["gradient"], unmasked)


def test_forget_returns_to_a_fresh_estimators_behaviour():
    # Warm-up steps verify dummy drafts that are nearly all accepted; after
    # forget() the estimator must predict and learn exactly as a fresh one.
    g = torch.Generator().manual_seed(3)
    fresh = OnlineAcceptanceEstimator(K, refit_interval=4, slope=0.5, intercept=-0.3)
    est = OnlineAcceptanceEstimator(K, refit_interval=4, slope=0.5, intercept=-0.3)
    for _ in range(10):  # warm-up: everything accepted, at an unrealistic feature
        f = torch.full((16, K), 5.0)
        est.observe(f, torch.full((16,), K), torch.full((16,), K))
    probe = torch.randn(8, K, generator=g)
    assert not torch.allclose(est.predict(probe), fresh.predict(probe))
    refits = est.num_refits
    est.forget()
    assert est.num_refits == refits + 1  # copiers of the coefficients see a change
    assert est.num_steps == 0
    torch.testing.assert_close(est.coefficients, fresh.coefficients)
    torch.testing.assert_close(est.prior_survival(), fresh.prior_survival())
    torch.testing.assert_close(est.mean_features, fresh.mean_features)
    assert est.slope == pytest.approx(fresh.slope)
    for _ in range(12):  # the same served steps afterwards: the same fit
        step = _simulate_step(g, 0.6, [1.0, 0.5, 0.0, -0.5, -1.0], 32)
        est.observe(*step)
        fresh.observe(*step)
    torch.testing.assert_close(est.coefficients, fresh.coefficients)
    torch.testing.assert_close(est.prior_survival(), fresh.prior_survival())
