"""Qwen3: per-head RMSNorm of queries and keys before the rotary embedding
(ModelConfig.qk_norm), no q/k/v bias, an explicit head_dim."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        assert cfg.qk_norm, "Qwen3 normalises q and k per head"
        super().__init__(cfg)
