import math

import torch

from vllm_av.core.features import (
    FEATURE_CLIP,
    draft_features,
    entropy,
    log_q_max,
    match_length_feature,
    top2_margin,
)


def _naive_logit_qmax(logits, t):
    q = torch.softmax(logits.double() / t, dim=-1)
    qm = q.max(-1).values
    return torch.log(qm / (1 - qm))


def test_draft_features_match_naive_logit_q_max_at_moderate_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 50, generator=g) * 2
    for t in (0.5, 1.0, 1.7):
        torch.testing.assert_close(
            draft_features(logits, t).double(), _naive_logit_qmax(logits, t), atol=1e-4, rtol=1e-4
        )


def test_draft_features_stay_finite_and_exact_at_huge_logits():
    logits = torch.tensor([[0.0, 40.0, 0.0, 0.0], [1e6, 0.0, -1e6, 3.0], [0.0, 0.0, 0.0, 0.0]])
    f = draft_features(logits, 1.0)
    assert torch.isfinite(f).all()
    # logit(q_max) = l_max - logsumexp(rest) = 40 - log 3 exactly, where the
    # naive formula rounds q_max to 1 and returns inf.
    assert abs(f[0].item() - min(40 - math.log(3), FEATURE_CLIP)) < 1e-4
    assert f[1].item() == FEATURE_CLIP
    # Uniform over 4: q_max = 1/4, logit = log(1/3).
    assert abs(f[2].item() - math.log(1 / 3)) < 1e-5
    assert torch.isfinite(_naive_logit_qmax(logits[:1], 1.0)).logical_not().all()


def test_greedy_temperature_is_scored_as_temperature_one():
    logits = torch.randn(3, 10)
    torch.testing.assert_close(draft_features(logits, 0.0), draft_features(logits, 1.0))
    temps = torch.tensor([0.0, 1.0, 2.0])
    expected = torch.stack(
        [draft_features(logits[0], 1.0), draft_features(logits[1], 1.0), draft_features(logits[2], 2.0)]
    )
    torch.testing.assert_close(draft_features(logits, temps), expected)


def test_tied_max_counts_once_as_max():
    f = draft_features(torch.tensor([2.0, 2.0, -1e9]), 1.0)
    assert abs(f.item()) < 1e-6  # q_max = 1/2 -> logit 0


def test_half_precision_logits_are_scored_in_float32():
    logits = torch.randn(4, 100) * 5
    torch.testing.assert_close(
        draft_features(logits.bfloat16(), 1.0), draft_features(logits.bfloat16().float(), 1.0)
    )


def test_margin_entropy_and_log_q_max_agree_with_probabilities():
    logits = torch.randn(6, 20)
    q = torch.softmax(logits, -1)
    top2 = q.topk(2, -1).values
    torch.testing.assert_close(top2_margin(logits), torch.log(top2[:, 0] / top2[:, 1]))
    torch.testing.assert_close(entropy(logits), -(q * q.log()).sum(-1))
    torch.testing.assert_close(log_q_max(logits), q.max(-1).values.log())
    masked = torch.tensor([0.0, float("-inf"), 0.0])
    assert abs(entropy(masked).item() - math.log(2)) < 1e-6


def test_match_length_feature_is_log1p_and_finite_at_zero():
    m = torch.tensor([0, 1, 4, 1000])
    torch.testing.assert_close(match_length_feature(m), torch.log1p(m.float()))
    assert match_length_feature([[-3, 2]]).shape == (1, 2)
    assert match_length_feature([-3]).item() == 0.0
