from __future__ import annotations

import pytest
import torch

from tandem.kernels import RMSNormResidual, rms_norm, rms_norm_ref


@pytest.mark.parametrize("hidden", [64, 96, 1000])
def test_matches_reference(seed, device, hidden):
    num_tokens = 7
    base = torch.randn(num_tokens, hidden + 32, device=device)
    x = base[:, 16:16 + hidden]  # row stride != hidden
    weight = torch.randn(hidden, device=device)
    out = torch.full((num_tokens, hidden), float("nan"), device=device)
    got = rms_norm(x, weight, 1e-5, out=out)
    assert got is out
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-5), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}\n{m}")


@pytest.mark.parametrize("hidden", [64, 200])
def test_with_residual(seed, device, hidden):
    x, residual = torch.randn(6, hidden, device=device), torch.randn(6, hidden, device=device)
    x0, r0 = x.clone(), residual.clone()
    weight = torch.randn(hidden, device=device)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    got = rms_norm(x, weight, 1e-5, residual, out=out, residual_out=res_out)
    ref = rms_norm_ref(x, weight, 1e-5, residual)
    assert isinstance(got, RMSNormResidual) and isinstance(ref, RMSNormResidual)
    assert got.out is out and got.residual is res_out
    torch.testing.assert_close(got.out, ref.out, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed={seed}\n{m}")
    torch.testing.assert_close(got.residual, x0 + r0, msg=lambda m: f"seed={seed}\n{m}")
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs were modified"


def test_reference_is_hf_llama_rmsnorm(seed):
    """The reference rounds as transformers' LlamaRMSNorm does, in bfloat16 too."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-5), norm(x)), f"seed={seed}"
