"""Qwen3: per-head RMSNorm of queries and keys before the rotary embedding, an explicit
head_dim (the config's, which ModelConfig reads for every model), q/k/v biases only where the
config's attention_bias asks."""

from __future__ import annotations

from tandem.engine.models.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
    gguf_architecture = "qwen3"
