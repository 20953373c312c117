"""The KV cache's dtype (`--kv-cache-dtype`) and, for FP8, its scales.

An FP8 pool stores e4m3 (torch.float8_e4m3fn): 1 byte an element where the model dtype takes
2 or 4, so the same memory holds 2x the tokens of bf16 and a handoff moves half the bytes.
Element x of layer l, KV head h is stored as

    clamp(x / scale[l, h], -448, 448) in e4m3, rounded to nearest even

and read back as stored * scale[l, h] (kernels/_common.py). The scales are static, set before
any KV is written: 1.0 (vLLM's default), or the calibrated scales an FP8 checkpoint carries
(`CheckpointKVScales`, below). A scale computed at write time would differ between the blocks
of one sequence, between requests sharing a prefix block, and between a prefill and a decode
worker whose pages are copied byte for byte; static scales are the same on every worker by
construction, so pages move unchanged. benchmarks/engine/fp8_accuracy.py measures what 1.0 costs
against per-(layer, head) scales calibrated on a prefill.

Checkpoint scales. FP8 checkpoints from the common tools carry, per decoder layer N, a K and a
V scale with exactly this meaning (stored = x / scale, so scale = amax / 448 when calibrated),
under one of these names (prefix `model.layers.N.self_attn.`):

    k_scale, v_scale                          (vLLM / AutoFP8 / HF FP8, llm-compressor)
    kv_scale                                  (older: one scale for both K and V)
    k_proj.output_scale, v_proj.output_scale  (compressed-tensors kv_cache_scheme, Quark)
    k_proj.k_scale, v_proj.v_scale            (ModelOpt)

each either one element (the layer's scale, broadcast over its KV heads) or one element per KV
head of the model. Under tensor parallelism a rank takes its own heads' scales
(engine/parallel.py `rank_heads`: a slice, or one replicated head when the group is larger
than the model's KV heads). The rule is all or nothing: a checkpoint that carries any KV scale
must carry a K and a V scale for every layer (a missing one is an error naming it), one
spelling per layer; each must be finite and positive (an error names the tensor). With an FP8
cache they replace the 1.0s; with `--kv-cache-dtype auto` they are read, not checked, and
ignored (one info log line).

Both workers of a disaggregated pair load the same checkpoint and so hold the same scales: a
prefill worker's FP8 pages mean the same on the decode worker and move unchanged. The pool
descriptor checks the dtype only (kvtransfer/descriptor.py); pairing workers started from
different checkpoints is not detected, as with their weights.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import NamedTuple

import torch

from tandem.engine.config import KV_CACHE_DTYPES
from tandem.errors import InvalidArgument, ModelLoadError

log = logging.getLogger(__name__)

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


# Checkpoint spellings of a layer's KV-cache scales (after `model.layers.N.self_attn.`): which
# scales each one sets.
_SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v"),
    "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",),
    "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),
}
_SCALE_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(" +
                       "|".join(re.escape(n) for n in _SCALE_NAMES) + r")")


class CheckpointKVScales:
    """Reads a checkpoint's KV-cache scales (the module docstring lists the names and the
    rules) into `target`, this rank's KVScales, or ignores them when target is None (no FP8
    cache). The weight loader offers it every tensor first (`take`) and calls `finish` once
    all were seen."""

    def __init__(self, target: KVScales | None, num_layers: int, num_kv_heads: int,
                 heads: range | None = None) -> None:
        self.target = target
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads  # the model's; `heads` are this rank's, in pool order
        self.heads = heads if heads is not None else range(num_kv_heads)
        if target is not None and tuple(target.k.shape) != (num_layers, len(self.heads)):
            raise ValueError(f"KV scales of shape {tuple(target.k.shape)} for {num_layers} "
                             f"layers and heads {self.heads}")
        # (layer, "k" | "v") -> (tensor name, [num_kv_heads] fp32 values)
        self.found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
        self.names: list[str] = []

    def take(self, name: str, read: Callable[[], torch.Tensor], source: str) -> bool:
        """True when `name` is a KV-cache scale (then it is read here, with `read`, and must
        not be loaded as a weight); False for every other tensor."""
        m = _SCALE_RE.fullmatch(name)
        if m is None:
            return False
        self.names.append(name)
        if self.target is None:
            return True
        layer = int(m.group(1))
        if layer >= self.num_layers:
            raise ModelLoadError(f"tensor {name} in {source} has no place in a model of "
                                 f"{self.num_layers} layers")
        values = _per_head(name, source, read(), self.num_kv_heads)
        for which in _SCALE_NAMES[m.group(2)]:
            other = self.found.get((layer, which))
            if other is not None:
                raise ModelLoadError(f"model: layer {layer}'s {which.upper()} cache scale is "
                                     f"given twice, by {other[0]} and by {name}")
            self.found[(layer, which)] = (name, values)
        return True

    def finish(self, where: str) -> None:
        """Check that every layer has both scales and write them into the target."""
        if not self.names:
            return
        if self.target is None:
            log.info("%s carries KV-cache scales (%d tensors, e.g. %s); ignored: the KV cache "
                     "is not FP8 (--kv-cache-dtype auto)", where, len(self.names),
                     self.names[0])
            return
        missing = [f"model.layers.{layer}.self_attn.{which}_scale"
                   for layer in range(self.num_layers) for which in ("k", "v")
                   if (layer, which) not in self.found]
        if missing:
            raise ModelLoadError(
                f"model: {where} carries KV-cache scales for some layers but not all (every "
                f"layer needs a K and a V scale); missing: {', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        heads = torch.tensor(list(self.heads), dtype=torch.long)
        k, v = (torch.stack([self.found[(layer, which)][1] for layer in range(self.num_layers)])
                [:, heads] for which in ("k", "v"))
        self.target.set(k, v)
        per_head = any(not torch.all(t == t[0]) for _, t in self.found.values())
        log.info("FP8 KV cache: scales from %s for %d layers (%s), KV heads %d..%d",
                 where, self.num_layers, "per KV head" if per_head else "one per layer",
                 self.heads.start, self.heads.stop - 1)


def _per_head(name: str, source: str, tensor: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A checkpoint scale as fp32 [num_kv_heads]: one element broadcast, or one a head."""
    t = tensor.detach().to("cpu", torch.float32).reshape(-1)
    if t.numel() == 1:
        t = t.expand(num_kv_heads)
    elif t.numel() != num_kv_heads:
        raise ModelLoadError(f"tensor {name} in {source} has {t.numel()} elements; a KV-cache "
                             f"scale has one, or one per KV head ({num_kv_heads})")
    if not bool(torch.all(torch.isfinite(t) & (t > 0))):
        raise ModelLoadError(f"tensor {name} in {source} holds {t.tolist()}: a KV-cache scale "
                             "must be finite and positive")
    return t.clone()
