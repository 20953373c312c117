"""kernels/fp8_gemv.py against its reference (CPU under TRITON_INTERPRET=1): both paths (M == 1
on the CUDA cores, M > 1 through tl.dot), ragged N and K tails, bias, bf16 and fp32 x,
per-channel and per-tensor (constant) scales; and the dispatch rule of fp8_linear."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.quantization.fp8 import GEMV_MAX_M, linear_path, quantize_weight
from tandem.kernels import Fp8GemvConfig, fp8_gemv, fp8_gemv_ref
from tandem.kernels._common import FP8_DTYPE, FP8_MAX

# Small tiles so that the shapes below have several N tiles with a ragged last one and a
# ragged last K tile: N = 40 is not a multiple of 16 or 32, K = 200 not one of 64.
SMALL = Fp8GemvConfig(gemv_block_n=16, gemv_block_k=64, dot_block_n=32, dot_block_k=64,
                      programs_per_sm=0)


def _weights(n: int, k: int, per_tensor: bool, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=device) * 0.05
    if not per_tensor:
        return quantize_weight(w)
    scale = w.abs().max() / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1).expand(n).contiguous()


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: summation order only; bf16: one rounding of the same fp32 sum (an ulp, 2^-8).
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    atol = ref.float().abs().max().item() * rtol
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("m", [1, 3, 16, 19])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_matches_reference(seed, device, m, dtype, bias, per_tensor):
    n, k = 40, 200
    w, s = _weights(n, k, per_tensor, device)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = fp8_gemv(x, w, s, b, config=SMALL)
    ref = fp8_gemv_ref(x, w, s, b)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, ref, dtype)


@pytest.mark.parametrize("m", [1, 5])
def test_default_config_and_strided_rows(seed, device, m):
    """The default tiles (one K tile larger than K) and x rows further apart than K."""
    n, k = 24, 96
    w, s = _weights(n, k, False, device)
    base = torch.randn(m, k + 32, device=device, dtype=torch.bfloat16)
    x = base[:, 16:16 + k]
    _close(fp8_gemv(x, w, s), fp8_gemv_ref(x.contiguous(), w, s), torch.bfloat16)


def test_out_argument_and_empty(device):
    w, s = _weights(8, 32, False, device)
    x = torch.randn(2, 32, device=device)
    out = torch.full((2, 8), float("nan"), device=device)
    assert fp8_gemv(x, w, s, out=out) is out
    _close(out, fp8_gemv_ref(x, w, s), torch.float32)
    assert fp8_gemv(x[:0], w, s).shape == (0, 8)


def test_argument_checks(device):
    w, s = _weights(8, 32, False, device)
    x = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="w must be e4m3"):
        fp8_gemv(x, w.float(), s)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemv(x, w, s[:4])
    with pytest.raises(ValueError, match="x must be"):
        fp8_gemv(x.to(torch.int32), w, s)
    with pytest.raises(ValueError, match="bias"):
        fp8_gemv(x, w, s, torch.zeros(3, device=device))


def test_dispatch_rule():
    """On CUDA: the weight-only kernel up to GEMV_MAX_M rows, torch._scaled_mm above;
    elsewhere the fp32 reference math."""
    assert GEMV_MAX_M == 1  # measured: the kernel wins at one row only (fp8.py)
    assert linear_path(1, True) == "gemv"
    assert [linear_path(m, True) for m in (2, 16, 300)] == ["scaled_mm"] * 3
    assert {linear_path(m, False) for m in (1, 16, 300)} == {"reference"}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-weights"])
def test_warm_up_runs_gemv_steps_with_fp8_weights(device, monkeypatch, fp8):
    """Start-up runs eager steps of 1 and of 3 tokens (the kernel at one row, _scaled_mm beyond)
    when the model has FP8 layers; the mixed and prefill steps are too large for the kernel."""
    from tandem.engine.quantization.fp8 import Fp8Linear
    from tandem.engine.warm_up import has_fp8_linear, warm_up

    layer = torch.nn.Linear(32, 16, device=device)
    model = torch.nn.Sequential(Fp8Linear.from_float(layer) if fp8 else layer)
    steps: list[list[int]] = []

    def step(lens: list[int], last: list[int]) -> None:  # the runner's eager step, recorded
        assert len(last) == len(lens)
        steps.append(lens)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    warm_up(step, object(), torch.zeros(8, 64, device=device), 16, torch.float32,  # type: ignore[arg-type]
            has_fp8_linear(model))
    tokens = [sum(lens) for lens in steps]
    assert tokens[:2] == [19, 19]  # block + 3: torch._scaled_mm
    assert tokens[2:] == ([1, 3] if fp8 else [])
    assert not fp8 or linear_path(tokens[2], True) == "gemv"
