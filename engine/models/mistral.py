"""Mistral: Llama's architecture with sliding-window attention. Tandem serves it up to its
window (ModelConfig.max_model_len), where sliding-window attention equals full attention.
llama.cpp writes Mistral's GGUF files as `llama`: LlamaForCausalLM serves those."""

from __future__ import annotations

from tandem.engine.models.layers import CausalLM


class MistralForCausalLM(CausalLM):
    pass
