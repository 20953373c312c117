"""FP8 (e4m3) linear layers and the transform that swaps them in, from outside the models.

    Fp8Linear:  y = (q(x) * s_x) @ (W_q * s_w[:, None])^T + b

W_q [out, in] in e4m3 with one fp32 scale per output channel s_w (a per-tensor scale, and each
shard's scale of a merged q/k/v or gate/up layer, becomes a constant run of channels); x is
quantized per token (s_x = amax(|x_row|) / 448) or with a checkpoint's static input_scale.
On CUDA with compute capability >= 8.9 this is one torch._scaled_mm with row-wise scales
(scale_a [M, 1], scale_b [1, N], bf16 out) above GEMV_MAX_M token rows; at or below it (decode
steps) the weight-only kernel kernels/fp8_gemv.py: y = x @ (W_q * s_w[:, None])^T + b with x
left in bf16 (no activation quantization, one launch, and more accurate than W8A8), so a
checkpoint's static input_scale does not apply there. Elsewhere a reference path computes the
W8A8 math in fp32 (dequantizing the weight on the fly): slow, for testing the loader and the
scale math on the CPU.

On the _scaled_mm path a layer may be handed its input already quantized (an Fp8Activation):
the norm or activation in front of it produced it in the same kernel
(engine/quantization/fp8_fusion.py), so it is not quantized again.

The transform (`prepare`, then load, then `finish`) touches the decoder layers' projections
(qkv_proj, o_proj, gate_up_proj, down_proj); embeddings and lm_head stay in the model dtype.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

import torch
from torch import nn

from tandem.engine.models.layers import CausalLM, MergedLinear
from tandem.engine.quantization.checkpoint import Fp8Scheme
from tandem.engine.quantization.kv_cache import FP8_DTYPE, FP8_MAX
from tandem.errors import InvalidArgument, ModelLoadError

MIN_CAPABILITY = (8, 9)  # Ada, Hopper and later have FP8 tensor cores
_MIN_AMAX = 1e-6  # kernels/fp8_quant.py MIN_AMAX
# Up to this many token rows fp8_linear runs the weight-only kernel. Measured on an H100
# (benchmarks/kernels/fp8_gemv.py, the four Llama-3.1-8B projections): at 1 row the kernel's CUDA-core
# path reads the weight at 1.8-2.6 TB/s, 1.1-2.1x faster than torch._scaled_mm with its
# activation quantization; at 16 rows its tensor-core path (the same cost for any 2-16 rows,
# one 16-row tile) is 0.6-0.73x of _scaled_mm. So: one row, the batch-1 decode step.
GEMV_MAX_M = 1
# torch._scaled_mm's use_fast_accum: Hopper's FP8 tensor cores accumulate in reduced precision
# between promotions to fp32 (the CUTLASS "fast accumulation" schedules). On an H200 at the 8B
# projections and 128-4,096 rows (benchmarks/kernels/fp8_scaled_mm.py) the GEMMs are 1.10x
# faster with it (1.80x bf16 against 1.63x) and their error against the fp32 product of the same
# e4m3 operands grows from 2-3e-3 to 5e-3-1e-2 of the output's largest value: under the e4m3
# inputs' own error (2**-4), and the whole model's accuracy is measured with it
# (benchmarks/engine/fp8_accuracy.py on CUDA).
FAST_ACCUM = True
# torch._scaled_mm's row-wise kernel (CUTLASS) is slow on small outputs: on an H200 at the 8B
# projections and 2-256 rows it reads the e4m3 weight at 28-42% of the copy bandwidth (o_proj,
# qkv, down: 14-38 us a GEMM, flat in the rows) where cuBLASLt's tensor-wise kernel, which takes
# one scale per operand, reads it at 40-77%. So a small product multiplies with scales of 1
# (cuBLASLt), its unscaled sums rounded to ACC_DTYPE, and kernels/fp8_scale_product.py applies
# the per-token and per-channel scales and the bias after it, in fp32. That pass costs 2-3 us at
# few rows and grows with the output: up to SCALES_AFTER_MAX_OUTPUT elements (M x N) it wins
# every shape measured (benchmarks/kernels/fp8_scaled_mm.py, N 2,048-28,672, K 4,096-14,336;
# o_proj 13.9 -> 9.9 us and down 37.5 -> 21.1 us at 96 rows); above it the row-wise kernel is
# faster at 21 of the 36 shapes measured, within 2% at 5, slower at 10 (its tile heuristics are
# uneven). A bf16 accumulator (one more rounding, 2**-9, under the fast accumulation's
# error) measured 0.5-2 us faster than fp32 at these sizes, and the pass writes over it.
SCALES_AFTER_MAX_OUTPUT = 1 << 20
ACC_DTYPE = torch.bfloat16


class Fp8Activation(NamedTuple):
    """Token rows already in e4m3 for an Fp8Linear on the _scaled_mm path: x ~= q * scale,
    quantized per token or with the layer's static input scale."""

    q: torch.Tensor  # e4m3 [M, K]
    scale: torch.Tensor  # fp32 [M, 1]
    dtype: torch.dtype  # what the rows were before quantizing: the matmul's output dtype

    @property
    def shape(self) -> torch.Size:
        """The rows' shape, as the float activation's (layers that read x.shape take both)."""
        return self.q.shape


class Fp8Linear(nn.Module):
    """An FP8 linear layer; `shard_sizes` (as MergedLinear's) when it stands for several
    projections stacked on the output dim, so that each loads from its own checkpoint tensor."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 shard_sizes: dict[str, int] | None = None, static_input: bool = False,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.shard_sizes = shard_sizes
        self.offsets: dict[str | None, int] = {None: 0}
        self.shard_index: dict[str | None, int] = {None: 0}
        off = 0
        for i, (name, size) in enumerate((shard_sizes or {}).items()):
            self.offsets[name], self.shard_index[name] = off, i
            off += size
        empty = dict(device=device, requires_grad=False)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE,
                                               device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32,
                                                    device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        # Static activations: one scale per shard as loaded; the layer uses their max.
        self.input_scale = (nn.Parameter(torch.zeros(max(1, len(shard_sizes or {})), **empty))
                            if static_input else None)
        for p in (self.weight, self.weight_scale, self.bias, self.input_scale):
            if p is not None:
                p.weight_loader = self._load
        self._input_scale: torch.Tensor | None = None  # fp32 [1], set by finalize()

    # -- loading -----------------------------------------------------------------------------
    def _rows(self, shard: str | None) -> slice:
        size = self.shard_sizes[shard] if shard is not None else self.out_features
        return slice(self.offsets[shard], self.offsets[shard] + size)

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None,
              name: str = "") -> None:
        rows = self._rows(shard)
        if param is self.input_scale:
            if tensor.numel() != 1:
                raise ModelLoadError(f"tensor {name}: one static input scale expected, got "
                                     f"{tensor.numel()}")
            param.data[self.shard_index[shard]] = tensor.float().reshape(())
        elif param is self.weight_scale:
            # One element (per tensor) or one per output channel ([out] or [out, 1]).
            n = rows.stop - rows.start
            if tensor.numel() not in (1, n):
                raise ModelLoadError(f"tensor {name}: {tensor.numel()} scales for {n} channels")
            param.data[rows] = tensor.float().reshape(-1).to(param.device)
        else:
            dst = param.data[rows]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"tensor {name}: shape {tuple(tensor.shape)} does not "
                                     f"match the config's {tuple(dst.shape)}")
            if param is self.weight and tensor.dtype != FP8_DTYPE:
                raise ModelLoadError(f"tensor {name}: an FP8 checkpoint's weight must be "
                                     f"float8_e4m3fn, got {tensor.dtype}")
            dst.copy_(tensor)

    def finalize(self) -> None:
        """After loading: the static input scale the layer uses (the max over its shards)."""
        if self.input_scale is not None:
            self._input_scale = self.input_scale.data.max().reshape(1).contiguous()

    @classmethod
    def from_float(cls, layer: nn.Linear | MergedLinear) -> Fp8Linear:
        """Quantize a loaded float layer per output channel: s_w = amax(|W_row|) / 448."""
        w = layer.weight.data
        out = cls(w.shape[1], w.shape[0], bias=layer.bias is not None,
                  shard_sizes=getattr(layer, "shard_sizes", None), dtype=w.dtype,
                  device=w.device)
        out.weight.data, out.weight_scale.data = quantize_weight(w)
        if layer.bias is not None:
            out.bias.data.copy_(layer.bias.data)
        return out

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, self._input_scale)
        shape = x.shape
        y = fp8_linear(x.reshape(-1, shape[-1]), self.weight, self.weight_scale, self.bias,
                       self._input_scale)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        static = "static" if self.input_scale is not None else "per-token"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activations={static}")


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 [out, in], fp32 scales [out]), one scale per output channel."""
    scale = w.float().abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale


def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 [M, 1]): kernels/fp8_quant.py on CUDA, its torch
    reference elsewhere."""
    if x.is_cuda:
        from tandem.kernels import quant_fp8  # noqa: PLC0415 - Triton is only needed on CUDA

        return quant_fp8(x, input_scale)
    xf = x.float()
    if input_scale is None:
        s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    else:
        s = input_scale.reshape(1, 1).expand(x.shape[0], 1)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def linear_path(m: int, is_cuda: bool) -> Literal["gemv", "scaled_mm", "reference"]:
    """How fp8_linear multiplies m token rows: the weight-only kernel (CUDA, m <= GEMV_MAX_M),
    torch._scaled_mm (CUDA, more rows) or the fp32 reference math (elsewhere)."""
    if not is_cuda:
        return "reference"
    return "gemv" if m <= GEMV_MAX_M else "scaled_mm"


def scales_after(m: int, n: int) -> bool:
    """Whether m token rows times an [n, K] e4m3 weight multiply unscaled (torch._scaled_mm
    with scales of 1: cuBLASLt's tensor-wise kernel) with the row and channel scales applied
    after it (kernels/fp8_scale_product.py), rather than in _scaled_mm's row-wise kernel."""
    return m * n <= SCALES_AFTER_MAX_OUTPUT


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A device fp32 scalar 1, made once per device (before any graph capture: warm-up runs
    every captured shape eagerly first)."""
    one = _UNIT_SCALES.get(device)
    if one is None:
        one = _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def fuses_quant(x: torch.Tensor) -> bool:
    """Whether the norm or activation computing x [M, K] for an Fp8Linear hands it an
    Fp8Activation: on the layer's _scaled_mm path, where x would be quantized anyway."""
    return linear_path(x.shape[0], x.is_cuda) == "scaled_mm"


def fp8_linear(x: torch.Tensor | Fp8Activation, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] in the model dtype, or already quantized (then input_scale was applied by
    whoever quantized it) -> [M, N]. On CUDA: up to GEMV_MAX_M rows the weight-only kernel
    (x stays in bf16; input_scale, a static activation scale, is not used), above it
    torch._scaled_mm on x quantized per token or with input_scale. Elsewhere fp32 math."""
    if isinstance(x, Fp8Activation):
        x_q, x_s, dtype = x
    else:
        if linear_path(x.shape[0], x.is_cuda) == "gemv":
            from tandem.kernels import fp8_gemv  # noqa: PLC0415 - Triton is only needed on CUDA

            return fp8_gemv(x, w, w_scale, bias)
        (x_q, x_s), dtype = quantize_activation(x, input_scale), x.dtype
    if x_q.is_cuda:
        if scales_after(x_q.shape[0], w.shape[0]):
            from tandem.kernels import fp8_scale_product  # noqa: PLC0415 - Triton, CUDA only

            one = _unit_scale(x_q.device)
            acc = torch._scaled_mm(x_q, w.t(), scale_a=one, scale_b=one, out_dtype=ACC_DTYPE,
                                   use_fast_accum=FAST_ACCUM)
            return fp8_scale_product(acc, x_s, w_scale, bias, dtype)
        y = torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=w_scale.view(1, -1),
                             out_dtype=dtype, use_fast_accum=FAST_ACCUM)
    else:
        y = ((x_q.float() * x_s) @ (w.float() * w_scale[:, None]).t()).to(dtype)
    return y if bias is None else y + bias


# -- the transform -------------------------------------------------------------------------------
def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """FP8 matmuls need FP8 tensor cores and, for row-wise scales, bf16 output."""
    if device.type != "cuda":
        return  # the reference path
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise InvalidArgument(
            "quantization", f"FP8 weights need a GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (Ada, Hopper); {device} is "
            f"{cap[0]}.{cap[1]}: drop --quantization fp8 or serve an unquantized checkpoint")
    if dtype != torch.bfloat16:
        raise InvalidArgument("dtype", f"FP8 weights on CUDA compute in bfloat16 (row-wise "
                                       f"scaled matmuls), got {dtype}: use --dtype bfloat16")


def projections(model: CausalLM, scheme: Fp8Scheme) -> list[tuple[str, nn.Module]]:
    """The decoder layers' linear layers the scheme quantizes, by module name."""
    out = []
    for name, mod in model.model.layers.named_modules(prefix="model.layers"):
        if isinstance(mod, nn.Linear | MergedLinear | Fp8Linear) and \
                not _ignored(model, name, mod, scheme.ignore):
            out.append((name, mod))
    return out


def prepare(model: CausalLM, scheme: Fp8Scheme) -> None:
    """Before loading an FP8 checkpoint: empty Fp8Linear layers in place of the projections,
    so that the loader fills their e4m3 weights and scales."""
    if not scheme.from_checkpoint:
        return
    for name, mod in projections(model, scheme):
        w = mod.weight
        _swap(model, name, Fp8Linear(
            w.shape[1], w.shape[0], bias=mod.bias is not None,
            shard_sizes=getattr(mod, "shard_sizes", None), static_input=scheme.static_input,
            dtype=w.dtype, device=w.device))


def finish(model: CausalLM, scheme: Fp8Scheme) -> None:
    """After loading: quantize the float projections (one layer at a time, so the peak is one
    layer's float weight beside the rest), or finalize the checkpoint's FP8 layers."""
    for name, mod in projections(model, scheme):
        if isinstance(mod, Fp8Linear):
            mod.finalize()
        else:
            _swap(model, name, Fp8Linear.from_float(mod))


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def _ignored(model: CausalLM, name: str, mod: nn.Module, ignore: tuple[str, ...]) -> bool:
    """Whether the checkpoint leaves this layer unquantized. A merged layer stands for several
    Hugging Face modules (q/k/v_proj, gate/up_proj): all or none of them may be ignored."""
    if not ignore:
        return False
    head, _, attr = name.rpartition(".")
    names = ([f"{head}.{frag}" for frag, (ours, _) in model.packed_modules.items()
              if ours == attr] if getattr(mod, "shard_sizes", None) else [name])
    hits = [any(_matches(n, pattern) for pattern in ignore) for n in names]
    if any(hits) and not all(hits):
        raise ModelLoadError(f"model: the checkpoint quantizes only some of {', '.join(names)}, "
                             f"which run as one merged layer ({name})")
    return all(hits)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)
