from __future__ import annotations

import pytest
import torch

from tandem.kernels import fp8_scale_product, fp8_scale_product_ref
from tandem.kernels._common import FP8_DTYPE


@pytest.mark.parametrize("n", [24, 3000])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(seed, device, n, acc_dtype, with_bias):
    m = 5
    # What _scaled_mm with scales of 1 returns: sums of e4m3 products, hundreds to millions.
    xq = (torch.randn(m, 64, device=device) * 100).to(FP8_DTYPE)
    wq = (torch.randn(n, 64, device=device) * 100).to(FP8_DTYPE)
    acc = (xq.float() @ wq.float().t()).to(acc_dtype)
    rows = torch.rand(m, 1, device=device) * 1e-3 + 1e-5
    cols = torch.rand(n, device=device) * 1e-4 + 1e-6
    bias = torch.randn(n, device=device).to(torch.bfloat16) if with_bias else None
    ref = fp8_scale_product_ref(acc, rows, cols, bias, torch.bfloat16)
    out = fp8_scale_product(acc.clone(), rows, cols, bias, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # Both scale in fp32 and round once to bf16; only the product's order may differ (an ulp).
    assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=0), f"seed={seed}"
    assert (out != ref).float().mean() < 0.01, f"seed={seed}"


def test_writes_over_an_accumulator_of_the_output_dtype(device):
    acc = torch.full((3, 40), 8.0, device=device, dtype=torch.bfloat16)
    rows = torch.tensor([[0.5], [1.0], [2.0]], device=device)
    cols = torch.full((40,), 0.25, device=device)
    out = fp8_scale_product(acc, rows, cols, None, torch.bfloat16)
    assert out.data_ptr() == acc.data_ptr()
    assert out[:, 0].tolist() == [1.0, 2.0, 4.0]


def test_rejects_mismatched_scales(device):
    acc = torch.zeros(3, 8, device=device)
    with pytest.raises(ValueError, match="row_scale"):
        fp8_scale_product(acc, torch.ones(4, device=device), torch.ones(8, device=device), None,
                          torch.bfloat16)
    with pytest.raises(ValueError, match="col_scale"):
        fp8_scale_product(acc, torch.ones(3, device=device), torch.ones(8, device=device,
                                                                         dtype=torch.float64),
                          None, torch.bfloat16)
