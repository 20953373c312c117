"""The models served: the one list. A line maps a Hugging Face architecture name (config.json's
`architectures[0]`) to the module of engine/models that defines the class of that name; the
class declares everything else about its model (engine/models/layers.py, `CausalLM`).

Plain data, no torch: the router and the launcher read it (ModelConfig refuses an architecture
not listed here) without loading a model; `tandem.engine.models.model_class` imports the module when a
model is built.
"""

from __future__ import annotations

from tandem.errors import ModelLoadError

MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
}

SUPPORTED_ARCHITECTURES = tuple(MODELS)


def check_architecture(architecture: str) -> None:
    if architecture not in MODELS:
        raise ModelLoadError(f"architecture {architecture!r} is not supported "
                             f"(supported: {', '.join(MODELS)})")
