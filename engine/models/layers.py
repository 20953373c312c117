"""Layers shared by every model. Projections are merged (q/k/v into one matmul, gate/up into
one) to cut kernel launches; the loader splits Hugging Face tensors into their shards.

Each parameter may carry `weight_loader(param, tensor, shard)`; the loader calls it with the
checkpoint tensor and the shard name from the model's `packed_modules`.

`CausalLM` is the base of every model and the declaration of what a model is (its class
attributes); a model file overrides what differs from Llama.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tandem.engine import ops
from tandem.engine.attention.base import Rope, get_forward_context
from tandem.engine.config import ModelConfig, RopeScaling
from tandem.errors import ModelLoadError


def _check_shape(param_name: str, expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise ModelLoadError(f"tensor {param_name}: shape {tuple(got)} does not match the "
                             f"config's {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard: str | None,
                          name: str = "") -> None:
    _check_shape(name, param.shape, tensor.shape)
    param.data.copy_(tensor)


class MergedLinear(nn.Module):
    """One matmul for several projections stacked on the output dim, e.g. q, k, v."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        self.offsets: dict[str, int] = {}
        off = 0
        for name, size in shard_sizes.items():
            self.offsets[name] = off
            off += size
        self.weight = nn.Parameter(torch.empty(off, in_features), requires_grad=False)
        self.weight.weight_loader = self._load
        self.bias = nn.Parameter(torch.empty(off), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self._load

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard: str | None,
              name: str = "") -> None:
        off, size = self.offsets[shard], self.shard_sizes[shard]
        dst = param.data.narrow(0, off, size)
        _check_shape(name, dst.shape, tensor.shape)
        dst.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies, with linear or llama3 scaling, as Hugging Face computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_pos, head_dim]: cos in the first half, sin in the second. Kept in float32.
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        """This step's rotary inputs; the attention backend applies them to q and k (on the
        GPU in the same kernel that stores K/V into the pool)."""
        return Rope(positions, self.cos_sin_cache)


@dataclass(frozen=True)
class AttentionOptions:
    """Where models' attention layers differ; the model class decides (CausalLM)."""

    qkv_bias: bool = False  # biases on the q, k and v projections
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before the rotary embedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int,
                 options: AttentionOptions = AttentionOptions()) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=options.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if options.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if options.qk_norm else None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        ctx = get_forward_context()
        out = ctx.backend.forward(self.layer_idx, q, k, v, ctx.metadata, self.rotary(positions))
        return self.o_proj(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
            bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int,
                 attention: AttentionOptions = AttentionOptions()) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """The `model.` part of a Hugging Face causal LM: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig,
                 make_layer: Callable[[int], DecoderLayer] | None = None) -> None:
        super().__init__()
        make_layer = make_layer or functools.partial(DecoderLayer, cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


def float_logits(lm_head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The LM head's float32 logits of `hidden` [T, H], into `out` when given. A plain bf16 or
    fp16 head on a GPU has the GEMM write float32 itself, its accumulator unrounded, where a
    half-precision product would be rounded and then converted by a copy kernel over the step's
    largest activation (the head alone: 0.77-0.99x the time at 1-512 rows of an 8B on an H200,
    benchmarks/kernels/gemm_rows.py --lm-head). Any other head (the CPU, float32, a
    tensor-parallel shard) is run and converted."""
    w = getattr(lm_head, "weight", None)
    if (type(lm_head) is nn.Linear and lm_head.bias is None and hidden.is_cuda
            and w.dtype in (torch.bfloat16, torch.float16) and hidden.dtype == w.dtype):
        if out is None:
            return torch.mm(hidden, w.t(), out_dtype=torch.float32)
        return torch.mm(hidden, w.t(), out_dtype=torch.float32, out=out)
    logits = lm_head(hidden)
    return logits.float() if out is None else out.copy_(logits)


# llama.cpp's tensor names (GGUF) -> Hugging Face's, for Llama-shaped models; {i}: the layer.
LLAMA_CPP_TENSORS = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}


class CausalLM(nn.Module):
    """Base of every model: `forward` gives hidden states of all tokens in the step,
    `compute_logits` the float32 logits of the rows that sample.

    What a model is, declared by its class (Llama's here; a model file overrides the rest) and
    read by the loader, the GGUF reader, tensor parallelism and the dummy weights, which are
    drawn for the model's own parameters (engine/loader.py). The registry
    (engine/models/registry.py) maps Hugging Face architecture names to classes."""

    # Per-head RMSNorm of queries and keys (Qwen3); biases on q, k, v: True, False, or None
    # for what the config's `attention_bias` says.
    qk_norm: ClassVar[bool] = False
    qkv_bias: ClassVar[bool | None] = None
    # Hugging Face tensor name fragment -> (our parameter name fragment, shard).
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    # GGUF (engine/gguf_checkpoint.py): the `general.architecture` served by this class (None:
    # no GGUF files), its tensor names, and whether llama.cpp's converter interleaved the two
    # rotary halves of each head's Q and K rows (it does for `llama`).
    gguf_architecture: ClassVar[str | None] = None
    gguf_tensors: ClassVar[dict[str, str]] = LLAMA_CPP_TENSORS
    gguf_interleaved_qk: ClassVar[bool] = False
    # The layer and the `model.` part a model file may replace with subclasses.
    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer
    decoder_model: ClassVar[type[DecoderModel]] = DecoderModel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        bias = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        options = AttentionOptions(qkv_bias=bias, qk_norm=self.qk_norm)
        self.model = self.decoder_model(
            cfg, functools.partial(self.decoder_layer, cfg, attention=options))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @property
    def attention_scale(self) -> float:
        """What q·k is multiplied by before the softmax (the attention backend applies it)."""
        return self.config.head_dim ** -0.5

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """float32 logits, written into `out` when given (a CUDA graph's static buffer)."""
        return float_logits(self.lm_head, hidden, out)
