"""Building a model on its device and filling its weights from safetensors (or at random)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from engine import gguf_checkpoint
from engine.config import ModelConfig
from engine.models import model_class
from engine.models.layers import CausalLM, default_weight_loader
from tandem.errors import ModelLoadError


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Parameters are created directly on the device in the serving dtype (no host copy of an
    8B model); rotary caches stay float32."""
    cls = model_class(cfg.architecture)
    with _default_dtype(dtype), torch.device(device):
        model = cls(cfg)
    for mod in model.modules():
        if hasattr(mod, "cos_sin_cache"):
            mod.cos_sin_cache = mod.cos_sin_cache.float()
    return model.eval()


def _hf_to_param(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for hf_frag, (ours, shard) in packed.items():
        if f".{hf_frag}." in name:
            return name.replace(f".{hf_frag}.", f".{ours}."), shard
    return name, None


def load_weights(model: CausalLM, path: Path, progress: bool = True) -> None:
    """Fill every parameter from the checkpoint in `path`: its *.safetensors files, or the GGUF
    file it links (engine/gguf_checkpoint.py), dequantized to the model's dtype."""
    params = dict(model.named_parameters())
    # Every (parameter, shard) that must be filled, so that a missing tensor is named.
    expected: set[tuple[str, str | None]] = set()
    for name in params:
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        shards = getattr(owner, "shard_sizes", None)
        expected.update((name, s) for s in (shards or [None]))
    tied = model.config.tie_word_embeddings
    if tied:
        expected.discard(("lm_head.weight", None))
    loaded: set[tuple[str, str | None]] = set()
    dtype = next(iter(params.values())).dtype
    for source, hf_name, tensor in _checkpoint_tensors(Path(path), dtype, progress):
        if "rotary_emb.inv_freq" in hf_name or (tied and hf_name == "lm_head.weight"):
            continue
        name, shard = _hf_to_param(hf_name, model.packed_modules)
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"tensor {hf_name} in {source} has no place in "
                                 f"{model.config.architecture}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor, shard, name=hf_name)
        loaded.add((name, shard))
    missing = sorted(expected - loaded, key=str)
    if missing:
        names = [f"{n} ({s})" if s else n for n, s in missing]
        raise ModelLoadError(f"model: tensors missing from {path}: {', '.join(names[:8])}"
                             + (f" and {len(names) - 8} more" if len(names) > 8 else ""))


def _checkpoint_tensors(path: Path, dtype: torch.dtype, progress: bool
                        ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file name, Hugging Face tensor name, tensor) for every tensor of the checkpoint."""
    gguf_file = gguf_checkpoint.weights_file(path)
    if gguf_file is not None:
        tensors = gguf_checkpoint.read_tensors(path, dtype)
        for name, tensor in tqdm(tensors, desc="Loading weights", unit=" tensors",
                                 disable=not progress):
            yield gguf_file.name, name, tensor
        return
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model: no *.safetensors files in {path}")
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
               desc="Loading weights", disable=not progress)
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for hf_name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield f.name, hf_name, st.get_tensor(hf_name)
        except SafetensorError as e:
            raise ModelLoadError(f"model: cannot read {f}: {e}") from e
        bar.update(f.stat().st_size)
    bar.close()


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights for speed measurements: the values do not change the work done.
    Small uniform values keep activations finite in bfloat16."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.uniform_(-0.02, 0.02, generator=gen)
