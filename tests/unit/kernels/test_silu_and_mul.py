from __future__ import annotations

import pytest
import torch

from tandem.kernels import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("inter", [64, 300, 2500])
def test_matches_reference(seed, device, inter):
    x = torch.randn(5, 2 * inter, device=device) * 4
    out = torch.full((5, inter), float("nan"), device=device)
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}\n{m}")


def test_strided_rows(seed, device):
    base = torch.randn(4, 300, device=device)
    x = base[:, :256]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}\n{m}")
