"""The trained confidence head: its model and loading from a state dict."""

import pytest
import torch

from vllm_av.core.confidence import ConfidenceHead


def test_head_is_a_sigmoid_of_one_linear_layer_over_hidden_and_previous_embedding():
    torch.manual_seed(0)
    head = ConfidenceHead(hidden_size=8, embedding_size=4)
    h, e = torch.randn(3, 5, 8), torch.randn(3, 5, 4)
    c = head(h, e)
    assert c.shape == (3, 5)
    w, b = head.proj.weight[0], head.proj.bias[0]
    expected = torch.sigmoid(torch.cat([h, e], -1) @ w + b)
    torch.testing.assert_close(c, expected)
    assert ((c > 0) & (c < 1)).all()
    with pytest.raises(ValueError, match="previous token"):
        head(h)


def test_head_loads_from_a_drafter_state_dict_and_is_absent_otherwise():
    torch.manual_seed(1)
    weight, bias = torch.randn(1, 12), torch.tensor([0.3])
    state = {
        "model.layers.0.weight": torch.randn(4, 4),
        "confidence_head.weight": weight,
        "confidence_head.bias": bias,
        "confidence_head.hidden_size": torch.tensor(8),
    }
    head = ConfidenceHead.from_state_dict(state)
    assert head is not None and head.hidden_size == 8 and head.embedding_size == 4
    h, e = torch.randn(2, 8), torch.randn(2, 4)
    torch.testing.assert_close(head(h, e), torch.sigmoid(torch.cat([h, e], -1) @ weight[0] + 0.3))
    assert ConfidenceHead.from_state_dict({"model.layers.0.weight": torch.randn(4, 4)}) is None
    with pytest.raises(ValueError, match=r"\[1, in_features\]"):
        ConfidenceHead.from_state_dict({"acceptance_head.weight": torch.randn(2, 8)})
