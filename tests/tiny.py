"""Tiny random checkpoints of every supported architecture, saved with transformers'
`save_pretrained`, plus the demo's byte-level tokenizer so text prompts work too.

Head dim 64 everywhere: the Triton kernels take 64, 128 and 256, so the same checkpoints run the
GPU parity test. Weights use a wider init than transformers' default so that logits are well
separated and the generated sequences vary (a tiny random model otherwise repeats one token).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from tandem.engine.demo import BOS_ID, END_OF_TEXT_ID, demo_model_dir

COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=END_OF_TEXT_ID,
              initializer_range=0.1)

ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                     {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64},
                "rope_theta": 500000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 1024}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # Qwen3: explicit head_dim different from hidden / heads, q/k norms.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"hidden_size": 192, "head_dim": 64}),
    # Granite: Llama with multipliers on the embeddings, residuals, attention and logits.
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                 "attention_multiplier": 0.25, "logits_scaling": 4.0}),
}


def build_tiny(name: str, out: Path) -> Path:
    cfg_cls, model_cls, extra = ARCHS[name]
    seed = list(ARCHS).index(name)
    config = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    # Norm weights start at one; perturb them so a mis-loaded norm cannot go unnoticed.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
            elif "bias" in pname:
                p.normal_(0, 0.1)
    model.save_pretrained(out)
    demo = demo_model_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (demo / f).exists():
            shutil.copy(demo / f, out / f)
    return out


def with_context(src: Path, out: Path, positions: int) -> Path:
    """A copy of the checkpoint at `src` that takes `positions` tokens of context: the same
    weights (rotary positions need none), a larger max_position_embeddings."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_tiny_draft(target: Path, out: Path, num_layers: int | None = None,
                     noise: float = 0.0) -> Path:
    """A draft model for the tiny checkpoint at `target` (same tokenizer): its first
    `num_layers` decoder layers (all by default), embeddings and head, with Gaussian noise of
    `noise` times each weight's std added, so that its guesses match the target's often but
    not always."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    if num_layers is not None:
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise * p.std())
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (target / f).exists():
            shutil.copy(target / f, out / f)
    return out
