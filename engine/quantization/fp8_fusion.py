"""FP8 weights: a decoder layer's activation quantization fused into the kernel in front of the
projection, for three of its four FP8 projections. Applied after the projections are FP8
(fp8.finish), by swapping the module that computes each projection's input:

    input_layernorm (+ residual add)   ->  qkv_proj       Fp8RMSNorm: kernels/rms_norm_quant_fp8.py
    post_attention_layernorm (+ add)   ->  gate_up_proj   Fp8RMSNorm: kernels/rms_norm_quant_fp8.py
    SiLU-and-mul                       ->  down_proj      Fp8MLP: kernels/silu_and_mul_quant_fp8.py
    attention output                   ->  o_proj         not fused: the layer quantizes it

Only where the projection would quantize its input anyway, on its torch._scaled_mm path
(fp8.fuses_quant: CUDA, more than GEMV_MAX_M token rows), does the swapped module return an
Fp8Activation (e4m3 rows and their per-token or static scale), which the Fp8Linear multiplies
as it is. Elsewhere (the batch-1 weight-only kernel, the CPU reference path) it returns what the
plain module returns. A projection left unquantized (a checkpoint's `ignore`) keeps its plain
modules in front, and models without FP8 weights never see these classes.

This relies on the layers' wiring (DecoderLayer and its subclasses): the normed x goes to the
attention or MLP block and nowhere else, and those (the plain Attention and MLP) pass it only to
their first projection; the plain MLP's SiLU-and-mul output goes only to its down projection.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine import ops
from tandem.engine.models.layers import MLP, Attention, CausalLM, DecoderLayer, RMSNorm
from tandem.engine.quantization.fp8 import Fp8Activation, Fp8Linear, fuses_quant


class Fp8RMSNorm(RMSNorm):
    """An RMSNorm (its loaded weight, shared) whose output only feeds an Fp8Linear: on the
    layer's _scaled_mm path one kernel adds the residual, normalizes and quantizes."""

    def __init__(self, norm: RMSNorm, input_scale: torch.Tensor | None) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.input_scale = input_scale  # the projection's static scale (fp32 [1]) or None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not fuses_quant(x):
            return super().forward(x, residual)
        from tandem.kernels import rms_norm_quant_fp8  # noqa: PLC0415 - Triton, CUDA only

        q, s, new_residual = rms_norm_quant_fp8(x, self.weight, self.eps, residual,
                                                scale=self.input_scale)
        act = Fp8Activation(q, s, x.dtype)
        return act if residual is None else (act, new_residual)


class Fp8MLP(MLP):
    """An MLP (its loaded projections, shared) whose down projection is FP8: on that
    projection's _scaled_mm path one kernel computes SiLU-and-mul and quantizes it."""

    def __init__(self, mlp: MLP) -> None:
        nn.Module.__init__(self)
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if not fuses_quant(h):
            return self.down_proj(ops.silu_and_mul(h))
        from tandem.kernels import silu_and_mul_quant_fp8  # noqa: PLC0415 - Triton, CUDA only

        q, s = silu_and_mul_quant_fp8(h, self.down_proj._input_scale)
        return self.down_proj(Fp8Activation(q, s, h.dtype))


def fuse_activation_quant(model: CausalLM) -> int:
    """Swap in the fused modules in front of the decoder layers' FP8 projections (after
    fp8.finish: the static input scales are final). Returns how many were swapped."""
    swapped = 0
    for layer in model.model.layers:
        if not isinstance(layer, DecoderLayer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is Attention and _plain_norm_before_fp8(layer.input_layernorm,
                                                             attn.qkv_proj):
            layer.input_layernorm = Fp8RMSNorm(layer.input_layernorm, attn.qkv_proj._input_scale)
            swapped += 1
        if type(mlp) is MLP and _plain_norm_before_fp8(layer.post_attention_layernorm,
                                                       mlp.gate_up_proj):
            layer.post_attention_layernorm = Fp8RMSNorm(layer.post_attention_layernorm,
                                                        mlp.gate_up_proj._input_scale)
            swapped += 1
        if type(mlp) is MLP and isinstance(mlp.down_proj, Fp8Linear):
            layer.mlp = Fp8MLP(mlp)
            swapped += 1
    return swapped


def _plain_norm_before_fp8(norm: nn.Module, proj: nn.Module) -> bool:
    return type(norm) is RMSNorm and isinstance(proj, Fp8Linear)
