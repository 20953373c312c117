"""The model registry is the one list of architectures: each entry resolves to its class, each
has a tiny checkpoint (so the parity tests against transformers cover it), the configuration
side reads it without torch, and what the classes declare (dummy weights, GGUF names) matches
real checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tandem.engine.config import ModelConfig
from tandem.engine.loader import checkpoint_layout, dummy_checkpoint
from tandem.engine.models import gguf_model_class, model_class
from tandem.engine.models.layers import CausalLM
from tandem.engine.models.registry import MODELS
from tandem.errors import ModelLoadError
from tiny import ARCHS


@pytest.mark.parametrize("architecture", list(MODELS))
def test_each_entry_names_its_class(architecture):
    cls = model_class(architecture)
    assert issubclass(cls, CausalLM) and cls.__name__ == architecture


def test_every_architecture_has_a_tiny_checkpoint():
    """tests/tiny.py builds one per registered architecture: the parity tests run on each."""
    assert {arch for _, arch, _ in ARCHS.values()} == set(MODELS)


def test_an_unlisted_architecture_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="'GPT2LMHeadModel' is not supported"):
        model_class("GPT2LMHeadModel")
    with pytest.raises(ModelLoadError, match=r"not supported.*Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["Gemma2ForCausalLM"], "vocab_size": 8,
                                  "hidden_size": 8, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 1})


def test_gguf_architectures_name_one_class_each():
    named = [model_class(a).gguf_architecture for a in MODELS]
    served = [g for g in named if g is not None]
    assert len(served) == len(set(served))
    for g in served:
        assert gguf_model_class(g).gguf_architecture == g


def test_the_configuration_side_imports_no_torch():
    """The router and the launcher read model configs and the registry without loading torch."""
    code = ("import sys, engine.config, engine.models, engine.models.registry; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", list(ARCHS))
def test_dummy_weights_have_a_real_checkpoints_names_and_shapes(tiny_models, name):
    """Dummy weights are drawn for the model's own parameters: the tensors of a checkpoint
    transformers saves for the architecture, no more, no less."""
    path = tiny_models[name]
    cfg = ModelConfig.from_dir(path)
    with safe_open(path / "model.safetensors", framework="pt") as st:
        real = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
    ours = {n: shape for n, shape, _ in checkpoint_layout(model_class(cfg.architecture), cfg)}
    assert ours == real


def test_dummy_norms_are_ones_and_the_rest_small(tiny_models):
    cfg = ModelConfig.from_dir(tiny_models["qwen3"])
    for _, name, t in dummy_checkpoint(model_class(cfg.architecture), cfg, torch.float32,
                                       torch.device("cpu"), seed=0):
        if "norm" in name:
            assert torch.equal(t, torch.ones_like(t)), name
        else:
            assert t.abs().max() <= 0.02 and t.std() > 0, name
