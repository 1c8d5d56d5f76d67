import numpy as np
import torch

from vllm_av.core.survival import survival


def test_survival_is_cumprod_along_positions_for_numpy():
    conf = np.array([[0.9, 0.5, 0.2], [1.0, 0.0, 0.7]])
    out = survival(conf)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [[0.9, 0.45, 0.09], [1.0, 0.0, 0.0]])


def test_survival_keeps_torch_dtype_and_device():
    conf = torch.rand(4, 7, dtype=torch.float64)
    out = survival(conf)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    torch.testing.assert_close(out, torch.cumprod(conf, 1))
    assert torch.all(out[:, 1:] <= out[:, :-1])
