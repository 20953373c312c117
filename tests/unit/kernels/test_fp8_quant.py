from __future__ import annotations

import pytest
import torch

from tandem.kernels import quant_fp8, quant_fp8_ref
from tandem.kernels._common import FP8_MAX


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("k", [64, 200, 5000])
def test_per_token_matches_reference(seed, device, k):
    x = torch.randn(7, k, device=device) * torch.logspace(-3, 3, 7, device=device)[:, None]
    x[2] = 0.0  # an all-zero row: a tiny scale, zeros out
    q, s = quant_fp8(x)
    q_ref, s_ref = quant_fp8_ref(x)
    assert s.shape == (7, 1) and q.shape == x.shape
    assert torch.equal(s, s_ref), f"seed={seed}"
    assert torch.equal(_bytes(q), _bytes(q_ref)), f"seed={seed}"
    # Each row's largest element maps to +-448 and the row comes back within e4m3 rounding.
    assert torch.all(q.float().abs().amax(1)[[0, 1, 3, 4, 5, 6]] == FP8_MAX)
    # (relative 2^-4 in e4m3's normal range; absolute s * 2^-10 among its subnormals)
    assert torch.all((q.float() * s - x).abs() <= x.abs() * 2**-4 + s * 2**-10), f"seed={seed}"


def test_static_scale_saturates(seed, device):
    x = torch.randn(5, 96, device=device)
    x[1, 3] = 1e4
    scale = torch.tensor([0.01], device=device)
    q, s = quant_fp8(x, scale)
    q_ref, s_ref = quant_fp8_ref(x, scale)
    assert torch.equal(s, s_ref) and torch.all(s == 0.01)
    assert torch.equal(_bytes(q), _bytes(q_ref)), f"seed={seed}"
    assert q[1, 3].float() == FP8_MAX


def test_strided_rows(device):
    base = torch.randn(4, 160, device=device)
    x = base[:, 16:144]  # rows 160 apart, last dim contiguous
    q, s = quant_fp8(x)
    q_ref, s_ref = quant_fp8_ref(x.contiguous())
    assert torch.equal(_bytes(q), _bytes(q_ref)) and torch.equal(s, s_ref)
