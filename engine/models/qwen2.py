"""Qwen2 / Qwen2.5: Llama's layout with a bias on the q, k and v projections
(ModelConfig.qkv_bias, which the shared Attention layer honours)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        assert cfg.qkv_bias, "Qwen2 has q/k/v biases"
        super().__init__(cfg)
