"""A tiny random checkpoint (tests/tiny.py) written as a GGUF file the way llama.cpp's converter
writes one: its tensor names, Q/K rows interleaved per head for the `llama` architecture, 2-D
weights quantized, and a byte-level tokenizer in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from engine.gguf_checkpoint import LAYER_NAMES, TOP_NAMES

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
TOP = {hf: g for g, hf in TOP_NAMES.items()}
LAYER = {hf: g for g, hf in LAYER_NAMES.items()}


def interleave_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in TOP:
        return f"{TOP[base]}.{kind}"
    parts = base.split(".")  # model.layers.<i>.<module path>
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:])]}.{kind}"


def write_gguf(checkpoint: Path, out: Path,
               quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0) -> Path:
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, checkpoint, cfg)
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
