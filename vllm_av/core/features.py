"""Lossless features of draft distributions.

A feature here decides how likely a draft slot is to be accepted, and through
the survival score whether the slot is verified at all. DESIGN 2.1's
losslessness rule therefore applies: a feature of slot i may depend on the
draft *distribution* q_i (which is fixed before x_i is sampled) but never on
the sampled token x_i itself. Every function below is a function of the
logits of q_i only; `q_i(x_i)` ("q_sampled") is deliberately not offered.

All functions take logits of any leading shape `[..., V]` and return
`[...]` float32 tensors (computed in float32 even for bf16/fp16 logits,
because logsumexp in half precision loses the tail that decides q_max near 1).
"""

from __future__ import annotations

import torch

# logit(q_max) is clipped to +-FEATURE_CLIP. 30 nats is a probability gap of
# e^-30 ~ 1e-13, far below anything a float32 softmax can resolve, so no real
# information is lost; the clip keeps a one-token vocabulary (logit = +inf) or
# a constant-logit row from sending inf into the estimator.
FEATURE_CLIP = 30.0


def _scaled_logits(draft_logits: torch.Tensor, temperature) -> torch.Tensor:
    """Logits of the temperature-scaled draft distribution, in float32.

    Greedy requests (temperature <= 0) are scored as temperature 1: greedy
    acceptance is a match of argmaxes, and the unscaled distribution's
    confidence is the natural proxy for it (dividing by 0 would make every
    row one-hot and the feature useless).
    """
    logits = draft_logits.float()
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=logits.device, dtype=torch.float32)
        t = torch.where(t > 0, t, torch.ones_like(t))
        # [...] -> [..., 1] so a per-request temperature broadcasts over V.
        return logits / t.unsqueeze(-1)
    t = float(temperature)
    return logits / t if t > 0 else logits


def draft_features(draft_logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """logit(q_max) of softmax(draft_logits / temperature): [..., V] -> [...].

    Computed without forming probabilities:
        log q_max       = l_max - logsumexp(l)
        log(1 - q_max)  = logsumexp(l without the argmax) - logsumexp(l)
        logit(q_max)    = l_max - logsumexp(l without the argmax)
    so it stays exact when q_max rounds to 1.0 in float32 (where the naive
    log(q / (1 - q)) returns inf). Ties for the max count once as the max and
    once among the rest, matching the probability definition.

    `temperature`: a float, or a tensor broadcastable to the leading shape
    (one per request); values <= 0 mean greedy and are treated as 1.
    Output is clipped to +-FEATURE_CLIP.
    """
    logits = _scaled_logits(draft_logits, temperature)  # [..., V]
    l_max, arg = logits.max(dim=-1, keepdim=True)  # [..., 1]
    # Remove exactly one copy of the max (a tied second max stays in "rest").
    rest = logits.scatter(-1, arg, float("-inf"))  # [..., V]
    lse_rest = torch.logsumexp(rest, dim=-1)  # [...]; -inf when V == 1
    feat = l_max.squeeze(-1) - lse_rest
    feat = torch.nan_to_num(feat, nan=0.0, posinf=FEATURE_CLIP, neginf=-FEATURE_CLIP)
    return feat.clamp(-FEATURE_CLIP, FEATURE_CLIP)


def log_q_max(draft_logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """log of the top draft probability: [..., V] -> [...], <= 0."""
    logits = _scaled_logits(draft_logits, temperature)
    return logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1)


def top2_margin(draft_logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """Top-1 minus top-2 scaled logit: [..., V] -> [...], >= 0.

    Equal to log(q_top1 / q_top2). With V == 1 there is no runner-up and the
    margin is FEATURE_CLIP (the row is certain).
    """
    logits = _scaled_logits(draft_logits, temperature)
    if logits.shape[-1] < 2:
        return torch.full(logits.shape[:-1], FEATURE_CLIP, device=logits.device)
    top2 = logits.topk(2, dim=-1).values  # [..., 2]
    margin = top2[..., 0] - top2[..., 1]
    return torch.nan_to_num(margin, nan=0.0, posinf=FEATURE_CLIP).clamp(0.0, FEATURE_CLIP)


def entropy(draft_logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """Shannon entropy of the scaled draft distribution in nats: [..., V] -> [...].

    Uses log_softmax and treats 0 * log 0 as 0, so -inf logits (masked
    vocabulary) are safe.
    """
    logits = _scaled_logits(draft_logits, temperature)
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    return -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(dim=-1)


def match_length_feature(match_len) -> torch.Tensor:
    """Feature for model-free drafters (ngram, suffix): log1p(match length).

    These drafters have no q, but the length of the context match that
    produced a draft predicts its acceptance: a longer match means the
    continuation was seen verbatim for longer. Acceptance saturates with
    length, so the log compresses long matches (a 40-token match is not ten
    times better than a 4-token one), and log1p keeps 0 (no match) finite.
    The estimator's slope and per-position intercepts then calibrate it on
    the fly exactly as for logit(q_max). Any leading shape; returns float32.
    """
    m = torch.as_tensor(match_len)
    return torch.log1p(m.float().clamp(min=0.0))


__all__ = [
    "FEATURE_CLIP",
    "draft_features",
    "entropy",
    "log_q_max",
    "match_length_feature",
    "top2_margin",
]
