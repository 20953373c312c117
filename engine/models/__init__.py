"""Models: one file per model, built from the shared layers (layers.py); the registry
(registry.py) lists them. Nothing here imports torch until a model class is asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tandem.engine.models.registry import MODELS, check_architecture
from tandem.errors import ModelLoadError

if TYPE_CHECKING:
    from tandem.engine.models.layers import CausalLM


def model_class(architecture: str) -> type[CausalLM]:
    """The class serving a Hugging Face architecture name (its module imported now)."""
    check_architecture(architecture)
    module = importlib.import_module(f"tandem.engine.models.{MODELS[architecture]}")
    return getattr(module, architecture)


def gguf_model_class(gguf_architecture: str) -> type[CausalLM]:
    """The class serving GGUF files of llama.cpp's `general.architecture` name."""
    served = {cls.gguf_architecture: cls for cls in map(model_class, MODELS)
              if cls.gguf_architecture is not None}
    try:
        return served[gguf_architecture]
    except KeyError:
        raise ModelLoadError(f"model: GGUF architecture {gguf_architecture!r} "
                             "(general.architecture) is not supported "
                             f"(supported: {', '.join(sorted(served))})") from None
