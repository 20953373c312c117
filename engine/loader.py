"""Building a model on its device and filling its weights from safetensors (or at random)."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from tandem.engine import gguf_checkpoint
from tandem.engine.config import ModelConfig
from tandem.engine.models import model_class
from tandem.engine.models.layers import CausalLM, RMSNorm, default_weight_loader
from tandem.engine.parallel import TPState, build_sharded_model
from tandem.engine.quantization.kv_cache import CheckpointKVScales
from tandem.errors import ModelLoadError


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                tp: TPState | None = None) -> CausalLM:
    """Parameters are created directly on the device in the serving dtype (no host copy of an
    8B model); rotary caches stay float32. With tp of size > 1: that rank's shard only
    (engine/parallel.py)."""
    cls = model_class(cfg.architecture)
    if tp is not None and tp.size > 1:
        return build_sharded_model(cls, cfg, dtype, device, tp)
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


def load_weights(model: CausalLM, path: Path, progress: bool = True,
                 kv_scales: CheckpointKVScales | None = None) -> None:
    """Fill every parameter from the checkpoint in `path`: its *.safetensors files, or the GGUF
    file it links (engine/gguf_checkpoint.py), dequantized to the model's dtype. A tensor-
    parallel shard's layers read only their rows or columns of each safetensors tensor.

    The checkpoint's KV-cache scales (engine/quantization/kv_cache.py) go to `kv_scales`;
    without one they are ignored, as for a KV cache that is not FP8."""
    dtype = next(model.parameters()).dtype
    _fill(model, _checkpoint_tensors(Path(path), dtype, progress), str(path), kv_scales)


def _fill(model: CausalLM, tensors: Iterator[tuple[str, str, Any]], where: str,
          kv_scales: CheckpointKVScales | None = None) -> None:
    """Every (source, Hugging Face name, tensor or LazyTensor) into its parameter, and the KV-
    cache scales into `kv_scales`; a missing or misplaced tensor is an error that names it."""
    cfg = model.config
    if kv_scales is None:
        kv_scales = CheckpointKVScales(None, cfg.num_layers, cfg.num_kv_heads)
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
    for source, hf_name, tensor in tensors:
        if "rotary_emb.inv_freq" in hf_name or (tied and hf_name == "lm_head.weight"):
            continue
        if kv_scales.take(hf_name, tensor.full if isinstance(tensor, LazyTensor)
                          else lambda t=tensor: t, source):
            continue
        name, shard = _hf_to_param(hf_name, model.packed_modules)
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"tensor {hf_name} in {source} has no place in "
                                 f"{model.config.architecture}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        if isinstance(tensor, LazyTensor) and not getattr(
                getattr(loader, "__self__", None), "accepts_lazy", False):
            tensor = tensor.full()
        loader(param, tensor, shard, name=hf_name)
        loaded.add((name, shard))
    missing = sorted(expected - loaded, key=str)
    if missing:
        names = [f"{n} ({s})" if s else n for n, s in missing]
        raise ModelLoadError(f"model: tensors missing from {where}: {', '.join(names[:8])}"
                             + (f" and {len(names) - 8} more" if len(names) > 8 else ""))
    kv_scales.finish(where)


class LazyTensor:
    """A safetensors tensor not read yet (valid while its file is open): `narrow` reads only the
    rows or columns asked for (a tensor-parallel shard's), `full` the whole tensor."""

    def __init__(self, st: Any, name: str) -> None:
        self._st, self._name = st, name
        self._slice = st.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + size)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._st.get_tensor(self._name)


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
                    yield f.name, hf_name, LazyTensor(st, hf_name)
        except SafetensorError as e:
            raise ModelLoadError(f"model: cannot read {f}: {e}") from e
        bar.update(f.stat().st_size)
    bar.close()


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights for speed measurements: the values do not change the work done.
    Small uniform values keep activations finite in bfloat16.

    Each tensor of the checkpoint the config describes is drawn whole from a generator seeded
    by its name and loaded like a real one: a tensor-parallel shard holds the same values as
    the unsharded model, so TP N and TP 1 compute the same function on dummy weights too."""
    p = next(model.parameters())
    _fill(model, dummy_checkpoint(type(model), model.config, p.dtype, p.device, seed),
          "dummy weights")


def dummy_checkpoint(model_cls: type[CausalLM], cfg: ModelConfig, dtype: torch.dtype,
                     device: torch.device, seed: int) -> Iterator[tuple[str, str, torch.Tensor]]:
    """("dummy", Hugging Face name, tensor) for every tensor of a checkpoint of `cfg`: norms
    ones, the rest small uniform values."""
    for name, shape, is_norm in checkpoint_layout(model_cls, cfg):
        if is_norm:
            yield "dummy", name, torch.ones(shape, dtype=dtype, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(
            name.encode()))
        yield "dummy", name, torch.empty(shape, dtype=dtype, device=device).uniform_(
            -0.02, 0.02, generator=gen)


def checkpoint_layout(model_cls: type[CausalLM], cfg: ModelConfig
                      ) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(Hugging Face name, shape, is a norm's weight) of every tensor a checkpoint of `cfg`
    holds, from the parameters of the whole (unsharded) model built on the meta device: each
    packed projection's shards named back through `packed_modules`, a tied LM head left out."""
    with torch.device("meta"):
        model = model_cls(cfg)
    unpacked = {packed: hf for hf, packed in model.packed_modules.items()}
    for name, param in model.named_parameters():  # a tied parameter once, by its first name
        path, _, kind = name.rpartition(".")
        owner = model.get_submodule(path)
        shards = getattr(owner, "shard_sizes", None)
        if shards is None:
            yield name, tuple(param.shape), isinstance(owner, RMSNorm)
            continue
        parent, _, ours = path.rpartition(".")
        for shard, size in shards.items():
            yield (f"{parent}.{unpacked[ours, shard]}.{kind}", (size, *param.shape[1:]),
                   False)
