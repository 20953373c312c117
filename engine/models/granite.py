"""IBM Granite (3.x): Llama's layout with four scalars from its config: the embeddings times
`embedding_multiplier`, each sublayer's output times `residual_multiplier` before it joins the
residual stream, q·k times `attention_multiplier` (in place of 1/sqrt(head_dim)), and the logits
divided by `logits_scaling`."""

from __future__ import annotations

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.models.layers import (
    AttentionOptions,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    float_logits,
)


def _scalar(cfg: ModelConfig, name: str) -> float:
    return float(cfg.hf_config.get(name, 1.0))  # transformers' GraniteConfig default


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int,
                 attention: AttentionOptions = AttentionOptions()) -> None:
        super().__init__(cfg, layer_idx, attention)
        self.residual_multiplier = _scalar(cfg, "residual_multiplier")

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # residual + multiplier * sublayer(x); the add happens in the next norm, as for Llama.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteModel(DecoderModel):
    def __init__(self, cfg: ModelConfig, make_layer) -> None:
        super().__init__(cfg, make_layer)
        self.embedding_multiplier = _scalar(cfg, "embedding_multiplier")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(CausalLM):
    decoder_layer = GraniteDecoderLayer
    decoder_model = GraniteModel

    @property
    def attention_scale(self) -> float:
        return _scalar(self.config, "attention_multiplier")

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        return float_logits(self.lm_head, hidden, out).div_(
            _scalar(self.config, "logits_scaling"))
