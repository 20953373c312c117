"""Model registry: Hugging Face architecture name -> model class."""

from __future__ import annotations

from engine.models.layers import CausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mistral import MistralForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from tandem.errors import ModelLoadError

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODELS[architecture]
    except KeyError:
        raise ModelLoadError(f"architecture {architecture!r} is not supported "
                             f"(supported: {', '.join(MODELS)})") from None
