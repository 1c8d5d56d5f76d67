"""Statistical losslessness of the AV pipeline on a toy target/draft pair.

Toy models: second-order Markov tables over a vocabulary of V = 4 tokens
(plus a BOS context symbol), target p(.|c2, c1) and draft q(.|c2, c1).
Requests start from (BOS, BOS); every step drafts K = 3 tokens from q, an
admission policy decides how many to verify, and `rejection_sample` (the
batched form of `verify_block`) emits the accepted prefix plus one
correction/bonus token. We collect the first L = 2 emitted tokens of many
independent requests and compare their empirical joint distribution with
the exact target joint using a chi-square goodness-of-fit test.

Each test is a fixed-seed draw, so it is deterministic; as a statistical
statement, a correct (lossless) pipeline fails a given test with probability
ALPHA = 0.001. Negative controls run the same harness with admission that
depends on the drafted token and must be detected (p < ALPHA):
  1. confidence = q_i(x_i) ("q_sampled") instead of a feature of q_i;
  2. the budget sized from the CURRENT step's survivals instead of last step's.
Requests are simulated as a batch (many engines of a few requests each) so
the whole module runs in seconds. With these tables the controls shift the
first token's law from (0.30, 0.60, 0.05, 0.05) to about (0.38, 0.49, ...)
(control 1) and (0.41, 0.44, ...) (control 2); at the sample sizes below
they give p ~ 1e-45 and 1e-60, so detection does not hinge on the seed, and
the lossless pipeline on the same tables and harness gives p ~ 0.3-0.5
(and p ~ 0.04 on the random tables: a fixed draw, above ALPHA).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_av.core import (
    CostModel,
    OnlineAcceptanceEstimator,
    draft_features,
    rejection_sample,
    select_admitted,
    size_budget,
    survival,
    verify_block,
)

ALPHA = 1e-3  # false-positive rate per lossless test
V, K, L = 4, 3, 2
BOS = V


def _random_tables(seed):
    rng = np.random.default_rng(seed)
    p = torch.from_numpy(rng.dirichlet([0.7] * V, size=(V + 1, V + 1)))  # [V+1, V+1, V]
    q = torch.from_numpy(rng.dirichlet([0.7] * V, size=(V + 1, V + 1)))
    # Keep every target cell away from 0 so chi-square cells are well filled.
    p = (p + 0.05) / (1 + 0.05 * V)
    return p, q


def _biased_tables():
    """Draft whose confidence at position 2 depends strongly on token 1, and a
    target far from it at position 1 (DSpark-style large bias)."""
    p = torch.empty(V + 1, V + 1, V, dtype=torch.float64)
    q = torch.empty_like(p)
    p[:] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    p[:, BOS] = torch.tensor([0.3, 0.6, 0.05, 0.05])  # first token
    p[:, 0] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p[:, 1] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q[:] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    q[:, BOS] = torch.tensor([0.6, 0.4, 0.0, 0.0])
    q[:, 0] = torch.tensor([0.94, 0.02, 0.02, 0.02])  # confident after token 0
    return p, q


def _target_joint(p):
    out = np.zeros([V] * L)
    for toks in itertools.product(range(V), repeat=L):
        c2, c1, prob = BOS, BOS, 1.0
        for t in toks:
            prob *= float(p[c2, c1, t])
            c2, c1 = c1, t
        out[toks] = prob
    return out.ravel()


def _chisquare_pvalue(counts, expected_probs):
    n = counts.sum()
    exp = expected_probs / expected_probs.sum() * n
    # Pool cells expected below 5 into one so the chi-square law holds.
    small = exp < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return chisquare(counts, exp).pvalue


class Policy:
    """Admission policy. `conf`: 'estimator' (lossless), 'q_max' (lossless,
    the unfitted prior: confidence = q_max), 'q_sampled' (control 1).
    `budget_from`: 'stale' (lossless) or 'current' (control 2); None means
    fixed admission `fixed` per request ('all' or 'none')."""

    def __init__(self, conf="estimator", budget_from="stale", cost=None, fixed=None):
        self.conf, self.budget_from, self.cost, self.fixed = conf, budget_from, cost, fixed


def _run(p, q, policy, num_requests, engines, batch, seed):
    """Simulate `engines` engines of `batch` requests each (continuous batching)
    until `num_requests` requests have emitted L tokens; return joint counts."""
    g = torch.Generator().manual_seed(seed)
    S = engines * batch
    est = OnlineAcceptanceEstimator(K)
    ctx = torch.full((S, 2), BOS, dtype=torch.long)  # [S, 2] (c2, c1)
    out = torch.zeros(S, L, dtype=torch.long)  # first L emitted tokens
    n_out = torch.zeros(S, dtype=torch.long)
    stale = est.prior_survival(K).expand(S, K).clone()  # [S, K]
    started = S
    counts = np.zeros(V**L, dtype=np.int64)
    done = 0
    active = torch.ones(S, dtype=torch.bool)
    while done < num_requests:
        # Draft K tokens from q; target probs at every drafted position + bonus.
        c2, c1 = ctx[:, 0].clone(), ctx[:, 1].clone()
        dprobs, tprobs, toks = [], [], []
        for _ in range(K):
            qi = q[c2, c1]
            tprobs.append(p[c2, c1])
            x = torch.multinomial(qi, 1, generator=g).squeeze(1)
            dprobs.append(qi)
            toks.append(x)
            c2, c1 = c1, x
        tprobs.append(p[c2, c1])
        dprobs = torch.stack(dprobs, 1)  # [S, K, V]
        tprobs = torch.stack(tprobs, 1)  # [S, K+1, V]
        toks = torch.stack(toks, 1)  # [S, K]
        num_drafted = torch.where(active, K, 0)  # [S]

        feats = draft_features(dprobs.log(), 1.0)  # [S, K]
        if policy.conf == "q_sampled":  # NOT lossless: depends on x_i
            conf = dprobs.gather(2, toks.unsqueeze(2)).squeeze(2).float()
        elif policy.conf == "q_max":
            conf = dprobs.max(2).values.float()
        else:
            conf = est.predict(feats)
        surv = survival(conf)  # [S, K]

        if policy.fixed == "all":
            admitted = num_drafted.clone()
        elif policy.fixed == "none":
            admitted = torch.zeros(S, dtype=torch.long)
        else:
            sized_on = stale if policy.budget_from == "stale" else surv
            admitted = torch.empty(S, dtype=torch.long)
            for e in range(engines):
                sl = slice(e * batch, (e + 1) * batch)
                nd = num_drafted[sl]
                n_act = int((nd > 0).sum())
                valid = torch.arange(K) < nd.unsqueeze(1)
                scores = sized_on[sl][valid].numpy()
                B = size_budget(scores, n_act, n_act, n_act, policy.cost)
                admitted[sl] = select_admitted(surv[sl], nd, B).long()

        emitted, n_emit = rejection_sample(tprobs, dprobs, toks, admitted, g)
        est.observe(feats, admitted, n_emit - 1)

        # Record the first L emitted tokens; advance the context.
        for j in range(K + 1):
            m = active & (j < n_emit) & (n_out < L)
            out[m, n_out[m]] = emitted[m, j]
            n_out += m.long()
            upd = active & (j < n_emit)
            ctx[upd] = torch.stack([ctx[upd, 1], emitted[upd, j]], 1)
        stale = surv.detach().clone()
        finished = active & (n_out >= L)
        idx = (out[finished] * torch.tensor([V ** (L - 1 - i) for i in range(L)])).sum(1)
        counts += np.bincount(idx.numpy(), minlength=V**L)
        done += int(finished.sum())
        # Continuous batching: finished slots take a new request with the prior.
        new = finished & (started < num_requests)
        n_new = int(new.sum())
        started += n_new
        active &= ~finished | new
        ctx[new] = BOS
        out[new] = 0
        n_out[new] = 0
        stale[new] = est.prior_survival(K)
    return counts


def _knee_cost(batch):
    """Staircase verify cost for an engine of `batch` requests (graphs at every
    profiled size): the first extra tokens are nearly free, later ones cost
    more and more, so the budget lands between 0 and all drafts and moves
    with the (stale) scores."""
    b = batch
    sizes = {b: [1.0], b + 2: [1.05], b + 4: [1.15], b + 8: [1.4], b + 16: [2.0], 4 * b: [3.0]}
    return CostModel.from_samples(sizes, {b: [0.1]}, sorted(sizes))


CONTROL_COST_B1 = CostModel.from_samples({1: [1.0], 4: [2.0]}, {1: [0.0]}, [1, 4])


@pytest.mark.parametrize("fixed", ["all", "none"])
def test_verification_is_lossless_with_all_or_no_drafts_admitted(fixed):
    p, q = _random_tables(0)
    counts = _run(p, q, Policy(fixed=fixed), 10000, 1, 512, seed=1)
    assert _chisquare_pvalue(counts, _target_joint(p)) > ALPHA


@pytest.mark.parametrize("tables", ["random", "biased"])
def test_av_pipeline_is_lossless(tables):
    p, q = _random_tables(2) if tables == "random" else _biased_tables()
    counts = _run(p, q, Policy(cost=_knee_cost(8)), 10000, 32, 8, seed=3)
    assert _chisquare_pvalue(counts, _target_joint(p)) > ALPHA


def test_av_pipeline_at_batch_one_with_stale_budget_is_lossless():
    # Same harness and tables as control 2, only the budget is stale.
    p, q = _biased_tables()
    counts = _run(p, q, Policy(conf="q_max", cost=CONTROL_COST_B1), 4000, 256, 1, seed=4)
    assert _chisquare_pvalue(counts, _target_joint(p)) > ALPHA


def test_control_q_sampled_confidence_is_detected():
    p, q = _biased_tables()
    counts = _run(p, q, Policy(conf="q_sampled", cost=_knee_cost(8)), 5000, 32, 8, seed=5)
    assert _chisquare_pvalue(counts, _target_joint(p)) < ALPHA


def test_control_budget_from_current_drafts_is_detected():
    p, q = _biased_tables()
    policy = Policy(conf="q_max", budget_from="current", cost=CONTROL_COST_B1)
    counts = _run(p, q, policy, 3000, 256, 1, seed=6)
    assert _chisquare_pvalue(counts, _target_joint(p)) < ALPHA


def test_verify_block_emits_the_target_distribution_per_request():
    # The per-request entry point, looped (slower, so fewer samples).
    p, q = _random_tables(7)
    g = torch.Generator().manual_seed(8)
    counts = np.zeros(V**L, dtype=np.int64)
    for n in range(2000):
        c2, c1, toks = BOS, BOS, []
        while len(toks) < L:
            dp, tp, xs = [], [], []
            d2, d1 = c2, c1
            for _ in range(K):
                dp.append(q[d2, d1])
                tp.append(p[d2, d1])
                x = int(torch.multinomial(q[d2, d1], 1, generator=g))
                xs.append(x)
                d2, d1 = d1, x
            tp.append(p[d2, d1])
            emitted = verify_block(torch.stack(tp), torch.stack(dp), torch.tensor(xs), n % (K + 1), g)
            assert 1 <= len(emitted) <= n % (K + 1) + 1
            for t in emitted:
                toks.append(t)
                c2, c1 = c1, t
        counts[toks[0] * V + toks[1]] += 1
    assert _chisquare_pvalue(counts, _target_joint(p)) > ALPHA
