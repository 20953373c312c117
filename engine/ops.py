"""Elementwise ops used by the model layers, chosen by device: Triton kernels on CUDA, plain
torch on the CPU. The torch versions follow Hugging Face's arithmetic exactly (float32 parity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _kernels():
    from tandem import kernels  # noqa: PLC0415 - Triton is only needed on CUDA

    return kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
    if x.is_cuda:
        shape = x.shape
        if residual is None:
            return _kernels().rms_norm(x.reshape(-1, shape[-1]), weight, eps).view(shape)
        return _kernels().rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Neox-style rotary embedding, in place on q [T, Hq, D] and k [T, Hkv, D]."""
    if q.is_cuda:
        _kernels().rotary_embedding(positions, q, k, cos_sin_cache)
        return
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = torch.cat((cs[:, :half], cs[:, :half]), -1)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), -1)[:, None, :]
    for t in (q, k):
        x1, x2 = t[..., :half], t[..., half:]
        rotated = torch.cat((-x2, x1), -1)
        t.copy_((t * cos + rotated * sin).to(t.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return _kernels().silu_and_mul(x)
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
