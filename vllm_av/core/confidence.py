"""Trained confidence head (DSpark style, DESIGN 2.1).

A drafter trained with a confidence head predicts, per draft position, the
probability that the slot is accepted given that the earlier ones were:

    c_i = sigmoid(w . [h_i ; e(x_{i-1})] + b)

with h_i the drafter's hidden state that produces draft distribution q_i,
and optionally e(x_{i-1}) the embedding of the previous token (the token the
drafter conditioned on, never the token x_i being judged: the head sees what
the drafter saw before sampling x_i, so admission on c_i stays lossless).

The head is one linear layer; this module defines it and loads its weights
from a checkpoint's state dict. Engines use it in place of the online
estimator when the draft checkpoint carries one.
"""

from __future__ import annotations

import torch
from torch import nn

# State-dict key prefixes under which drafter checkpoints store the head.
HEAD_PREFIXES = ("confidence_head.", "acceptance_head.")


class ConfidenceHead(nn.Module):
    """c = sigmoid(Linear([hidden ; prev_embedding])).

    Args:
        hidden_size: size of the drafter's hidden state.
        embedding_size: size of the previous-token embedding concatenated to
            it, or 0 for a head over the hidden state alone.
    """

    def __init__(self, hidden_size: int, embedding_size: int = 0) -> None:
        super().__init__()
        if hidden_size < 1 or embedding_size < 0:
            raise ValueError(
                f"hidden_size must be >= 1 and embedding_size >= 0, got "
                f"{hidden_size}, {embedding_size}"
            )
        self.hidden_size = hidden_size
        self.embedding_size = embedding_size
        self.proj = nn.Linear(hidden_size + embedding_size, 1)

    def forward(
        self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[..., H] (and [..., E]) -> confidences [...] in (0, 1)."""
        if self.embedding_size:
            if prev_embedding is None:
                raise ValueError("this head also takes the previous token's embedding")
            hidden = torch.cat([hidden, prev_embedding.to(hidden.dtype)], dim=-1)
        x = hidden.to(self.proj.weight.dtype)
        return torch.sigmoid(self.proj(x).squeeze(-1))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "ConfidenceHead | None":
        """The head stored in a drafter's state dict, or None if it has none.

        Looks for `<prefix>weight` [1, H + E] and `<prefix>bias` [1] under one
        of HEAD_PREFIXES; the split between H and E is recorded as
        `<prefix>hidden_size` (a 0-d tensor) when E > 0.
        """
        for prefix in HEAD_PREFIXES:
            weight = state.get(prefix + "weight")
            if weight is None:
                continue
            if weight.ndim != 2 or weight.shape[0] != 1:
                raise ValueError(f"{prefix}weight must be [1, in_features], got {tuple(weight.shape)}")
            total = weight.shape[1]
            hidden = state.get(prefix + "hidden_size")
            hidden_size = int(hidden) if hidden is not None else total
            head = cls(hidden_size, total - hidden_size)
            head.proj.weight.data.copy_(weight)
            bias = state.get(prefix + "bias")
            if bias is not None:
                head.proj.bias.data.copy_(bias.reshape(1))
            return head
        return None


__all__ = ["HEAD_PREFIXES", "ConfidenceHead"]
