"""Llama (1, 2, 3, 3.1, 3.2): RMSNorm, rotary (none, linear or llama3 scaling), GQA, SwiGLU."""

from __future__ import annotations

from tandem.engine.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    # llama.cpp's `llama` files, Mistral's included (served as Llama up to the window, below).
    gguf_architecture = "llama"
    gguf_interleaved_qk = True
