"""Reference lossless verification of an admitted draft prefix (DESIGN 2.5).

Standard speculative rejection sampling restricted to the admitted prefix:
for i < num_admitted, accept draft x_i with probability min(1, p_i(x_i) /
q_i(x_i)); at the first rejection emit a token from norm(max(0, p_i - q_i))
and stop; if every admitted draft is accepted, emit a bonus token from
p_{num_admitted}. Trimmed drafts (i >= num_admitted) are never looked at:
dropping them is lossless as long as num_admitted did not depend on them.

Used by tests and the simulator; the engine uses vLLM's sampler. The batched
form is vectorised over requests; `verify_block` is the one-request view of
the same code, so both consume randomness identically.
"""

from __future__ import annotations

import torch

# If p == q at the rejected position, norm(max(0, p - q)) is 0/0. Rejection
# then has probability 0, but rounding can still land there; falling back to
# p keeps the output a valid token from the right distribution.
_RESIDUAL_EPS = 1e-12


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_admitted: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched verification.

    target_probs [R, K+1, V], draft_probs [R, K, V], draft_tokens [R, K],
    num_admitted [R]. Returns (tokens [R, K+1] padded with -1,
    num_emitted [R] = accepted drafts + 1).
    """
    R, K1, V = target_probs.shape
    K = K1 - 1
    dev = target_probs.device
    n_adm = num_admitted.to(dev).long().clamp(0, K)  # [R]
    tok = draft_tokens.to(dev).long()  # [R, K]
    p_x = target_probs[:, :K].gather(2, tok.unsqueeze(2)).squeeze(2)  # [R, K]
    q_x = draft_probs.gather(2, tok.unsqueeze(2)).squeeze(2)  # [R, K]
    u = torch.rand(R, K, generator=generator, device=dev, dtype=target_probs.dtype)
    # u < p/q written without the division (q_x > 0 for a sampled token).
    accept = u * q_x < p_x  # [R, K]
    accept &= torch.arange(K, device=dev).unsqueeze(0) < n_adm.unsqueeze(1)
    num_accepted = torch.cumprod(accept.long(), dim=1).sum(1)  # [R]

    # Distribution of the extra token at position num_accepted.
    rows = torch.arange(R, device=dev)
    p_next = target_probs[rows, num_accepted]  # [R, V]
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    q_next = q_pad[rows, num_accepted]  # [R, V]; zeros at the bonus position
    rejected = (num_accepted < n_adm).unsqueeze(1)  # [R, 1]
    residual = torch.clamp(p_next - q_next, min=0.0)
    residual_ok = residual.sum(1, keepdim=True) > _RESIDUAL_EPS
    dist = torch.where(rejected & residual_ok, residual, p_next)  # [R, V]
    extra = torch.multinomial(dist, 1, generator=generator).squeeze(1)  # [R]

    pos = torch.arange(K1, device=dev).unsqueeze(0)  # [1, K+1]
    tok_pad = torch.cat([tok, torch.full_like(tok[:, :1], -1)], dim=1)
    out = torch.where(pos < num_accepted.unsqueeze(1), tok_pad, torch.full_like(tok_pad, -1))
    out.scatter_(1, num_accepted.unsqueeze(1), extra.unsqueeze(1))
    return out, num_accepted + 1


def verify_block(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_admitted: int,
    generator: torch.Generator | None = None,
) -> list[int]:
    """One request: target_probs [K+1, V], draft_probs [K, V], draft_tokens [K].

    Returns the emitted tokens: the accepted prefix, then the correction
    (first rejection) or bonus token (all admitted accepted).
    """
    out, n = rejection_sample(
        target_probs.unsqueeze(0),
        draft_probs.unsqueeze(0),
        draft_tokens.unsqueeze(0),
        torch.tensor([int(num_admitted)]),
        generator,
    )
    return out[0, : int(n[0])].tolist()


__all__ = ["rejection_sample", "verify_block"]
