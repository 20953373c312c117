"""Qwen2 / Qwen2.5: Llama's layout with a bias on the q, k and v projections, whatever the
config says (transformers' Qwen2 has no attention_bias field)."""

from __future__ import annotations

from tandem.engine.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
    gguf_architecture = "qwen2"
