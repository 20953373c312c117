"""The KV cache's dtype (`--kv-cache-dtype`) and, for FP8, its scales.

An FP8 pool stores e4m3 (torch.float8_e4m3fn): 1 byte an element where the model dtype takes
2 or 4, so the same memory holds 2x the tokens of bf16 and a handoff moves half the bytes.
Element x of layer l, KV head h is stored as

    clamp(x / scale[l, h], -448, 448) in e4m3, rounded to nearest even

and read back as stored * scale[l, h] (kernels/_common.py). The scales are static: 1.0 unless
set before any KV is written (vLLM's default). A scale computed at write time would differ
between the blocks of one sequence, between requests sharing a prefix block, and between a
prefill and a decode worker whose pages are copied byte for byte; static scales are the same
on every worker by construction, so pages move unchanged. benchmarks/fp8_accuracy.py measures
what 1.0 costs against per-(layer, head) scales calibrated on a prefill.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import KV_CACHE_DTYPES
from tandem.errors import InvalidArgument

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


class KVScales(NamedTuple):
    """fp32 [num_layers, num_kv_heads] each; layer l's rows are the kernels' k_scale, v_scale."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def ones(cls, num_layers: int, num_kv_heads: int, device: torch.device) -> KVScales:
        return cls(torch.ones(num_layers, num_kv_heads, device=device),
                   torch.ones(num_layers, num_kv_heads, device=device))

    def set(self, k: torch.Tensor | float, v: torch.Tensor | float) -> None:
        """Replace the scales in place (the kernels and captured CUDA graphs read these
        tensors). Only before any KV is stored: blocks written under other scales would be
        misread."""
        for dst, src in ((self.k, k), (self.v, v)):
            src = torch.as_tensor(src, dtype=torch.float32, device=dst.device)
            if not bool(torch.all(torch.isfinite(src) & (src > 0))):
                raise InvalidArgument("kv_scales", "must be finite and positive")
            dst.copy_(src.expand_as(dst))


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's torch dtype for `--kv-cache-dtype NAME`: auto is the model's dtype."""
    if name not in KV_CACHE_DTYPES:
        raise InvalidArgument("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                                f"got {name!r}")
    return model_dtype if name == "auto" else FP8_DTYPE


def check_device(kv_dtype: torch.dtype, device: torch.device) -> None:
    """The GPU kernels convert e4m3 in hardware: compute capability 8.9 (Ada, Hopper) on."""
    if kv_dtype != FP8_DTYPE or device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise InvalidArgument("kv_cache_dtype", f"an FP8 KV cache needs a GPU of compute "
                                                f"capability 8.9 or later; {device} is "
                                                f"{cap[0]}.{cap[1]}: use --kv-cache-dtype auto")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D], scale fp32 [H] -> e4m3, as the store kernels write it."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """Cache elements [..., H, D] as `dtype`: e4m3 times its head's scale, or just cast."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale[:, None]).to(dtype)
