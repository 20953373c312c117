"""A tiny random checkpoint (tests/tiny.py) written as a GGUF file the way llama.cpp's converter
writes one: its tensor names, Q/K rows interleaved per head for the `llama` architecture (Mistral
included), 2-D weights quantized, rotary scaling as metadata (linear) or as the rope_freqs tensor
(llama3), and a byte-level tokenizer with the demo's chat template in the metadata."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from tandem.engine.demo import CHAT_TEMPLATE
from tandem.engine.models.layers import LLAMA_CPP_TENSORS

# The architecture llama.cpp's converter writes for each (Mistral's files say `llama`).
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
GGUF_NAMES = {hf: g for g, hf in LLAMA_CPP_TENSORS.items()}  # "{i}": the layer


def interleave_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def llama3_rope_freqs(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1 scaling (one divisor
    per frequency), computed as convert_hf_to_gguf.py does."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    parts = base.split(".")  # model.layers.<i>.<module path>, or a top-level module
    if parts[:2] == ["model", "layers"]:
        template = ".".join(["model.layers.{i}", *parts[3:]])
        return f"{GGUF_NAMES[template].format(i=parts[2])}.{kind}"
    return f"{GGUF_NAMES[base]}.{kind}"


def write_gguf(checkpoint: Path, out: Path,
               quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
               extra: dict[str, str] | None = None) -> Path:
    """`checkpoint` as a GGUF file at `out`; `extra`: more string metadata."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny-mistral" if "Mistral" in cfg["architectures"][0] else f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(theta)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim, theta))
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, checkpoint, cfg)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    for name, tensor in load_file(str(checkpoint / "model.safetensors")).items():
        x = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            x = interleave_rows(x, heads)
        elif arch == "llama" and ".k_proj." in name:
            x = interleave_rows(x, kv_heads)
        if x.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(x, quant)
            w.add_tensor(_gguf_name(name), q, raw_shape=q.shape, raw_dtype=quant)
        else:
            w.add_tensor(_gguf_name(name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w: gguf.GGUFWriter, checkpoint: Path, cfg: dict) -> None:
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    ids = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["content"] for t in tok["added_tokens"]}
    tokens = [f"<|pad_{i}|>" for i in range(cfg["vocab_size"])]
    for text, i in ids.items():
        tokens[i] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special or t.startswith("<|pad_")
                       else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)  # as the original tokenizer does (Llama 3 style)
    w.add_chat_template(CHAT_TEMPLATE)
