"""Tensor parallelism as a transform: a model built for one device becomes rank r's shard of it
by swapping its plain layers for parallel ones (`shard_model`); the model files do not change.

    rank r of N                         layer                       after it
    ─────────────────────────────────   ─────────────────────────   ─────────────────────
    embed_tokens   rows [r*V/N, ...)    VocabParallelEmbedding      all-reduce (sum)
    qkv_proj       q heads r*Hq/N..,    ColumnParallelMergedLinear  attention on own heads
                   its KV heads (below)
    o_proj         input cols of those  RowParallelLinear           all-reduce (sum)
    gate_up_proj   cols [r*I/N, ...)    ColumnParallelMergedLinear
    down_proj      input cols of those  RowParallelLinear           all-reduce (sum)
    lm_head        rows [r*V/N, ...)    ParallelLMHead              all-gather (the logits)

KV heads: with N <= Hkv each rank owns Hkv/N of them; with N > Hkv (N a multiple of Hkv) each
KV head is replicated on N/Hkv ranks, rank r holding head r // (N/Hkv). Each rank's KV pool
holds only its own heads. Norms and rotary caches are replicated.

Collectives go through torch.distributed: `group` carries the tensors (NCCL on CUDA, gloo on the
CPU), `cpu_group` (gloo) the host-side messages of the step.

Weights: each parallel layer's loader narrows the checkpoint tensor to its rank's rows or
columns; given a lazy safetensors slice (`tandem.engine.loader.LazyTensor`) it reads only those.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.engine.config import ModelConfig, cdiv
from tandem.engine.models.layers import (
    MLP,
    Attention,
    CausalLM,
    MergedLinear,
    RotaryEmbedding,
    _check_shape,
)
from tandem.errors import InvalidArgument
from tandem.kvtransfer.tp_pull import kv_head_start, kv_heads_per_rank, rank_heads

# kv_head_start, kv_heads_per_rank, rank_heads: the KV heads each rank holds, one rule for the
# shards here and for the handoff between sizes (kvtransfer/tp_pull.py).
__all__ = ["TPState", "build_sharded_model", "check_tp_size", "init_tp", "kv_head_start",
           "kv_heads_per_rank", "rank_heads", "shard_model"]


@dataclass(frozen=True)
class TPState:
    """This process's place in its tensor-parallel group."""

    rank: int
    size: int
    group: Any = None  # torch.distributed ProcessGroup for tensors
    cpu_group: Any = None  # gloo group for host-side messages (the step's inputs)


# -- head partition (the rule itself lives with the handoff, kvtransfer/tp_pull.py) -----------
def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """Raise InvalidArgument naming --tensor-parallel-size when the model cannot split N ways."""
    field = "tensor_parallel_size"
    if tp < 1:
        raise InvalidArgument(field, f"must be >= 1, got {tp}")
    if tp == 1:
        return
    if cfg.num_heads % tp:
        raise InvalidArgument(field, f"{tp} does not divide the model's {cfg.num_heads} "
                                     "attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise InvalidArgument(field, f"{tp} neither divides nor is a multiple of the model's "
                                     f"{cfg.num_kv_heads} KV heads")
    if cfg.intermediate_size % tp:
        raise InvalidArgument(field, f"{tp} does not divide the MLP width "
                                     f"{cfg.intermediate_size}")


# -- loading shards ---------------------------------------------------------------------------
def take(tensor: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of a tensor or of a LazyTensor
    (which reads only those from its file)."""
    return tensor.narrow(dim, start, size)


# -- layers -----------------------------------------------------------------------------------
class ColumnParallelMergedLinear(MergedLinear):
    """MergedLinear holding this rank's rows of each stacked projection:
    slices[name] = (first row in the full projection, rows held)."""

    accepts_lazy = True

    def __init__(self, in_features: int, slices: dict[str, tuple[int, int]],
                 full_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, {n: size for n, (_, size) in slices.items()}, bias)
        self.slices = slices
        self.full_sizes = full_sizes

    def _load(self, param: nn.Parameter, tensor: Any, shard: str | None, name: str = "") -> None:
        if tensor.shape[0] != self.full_sizes[shard]:
            raise_shape(name, (self.full_sizes[shard], *tensor.shape[1:]), tensor.shape)
        start, size = self.slices[shard]
        super()._load(param, take(tensor, 0, start, size), shard, name)


class RowParallelLinear(nn.Module):
    """y = x_r @ W_r^T summed over ranks: this rank holds input columns [start, start + size)
    of a bias-free projection; the all-reduce makes every rank's output the full one."""

    accepts_lazy = True

    def __init__(self, in_features: int, out_features: int, start: int, size: int,
                 group: Any) -> None:
        super().__init__()
        self.in_features, self.start = in_features, start
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, size), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, tensor: Any, shard: str | None, name: str = "") -> None:
        if tensor.shape[1] != self.in_features:
            raise_shape(name, (param.shape[0], self.in_features), tensor.shape)
        src = take(tensor, 1, self.start, param.shape[1])
        _check_shape(name, param.shape, src.shape)
        param.data.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


class _VocabShard(nn.Module):
    """Rows [start, start + per) of a [vocab, hidden] table, the last rank's padded with zeros
    up to `per` (vocab need not divide by N)."""

    accepts_lazy = True

    def __init__(self, vocab: int, hidden: int, rank: int, tp: int, group: Any) -> None:
        super().__init__()
        self.vocab, self.tp, self.group = vocab, tp, group
        self.per = cdiv(vocab, tp)
        self.start = rank * self.per
        self.rows = max(0, min(self.per, vocab - self.start))
        self.weight = nn.Parameter(torch.empty(self.per, hidden), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, tensor: Any, shard: str | None, name: str = "") -> None:
        if tensor.shape[0] != self.vocab:
            raise_shape(name, (self.vocab, param.shape[1]), tensor.shape)
        param.data[self.rows:].zero_()
        if self.rows:
            src = take(tensor, 0, self.start, self.rows)
            _check_shape(name, param.data[:self.rows].shape, src.shape)
            param.data[:self.rows].copy_(src)


class VocabParallelEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(x, group=self.group)  # exactly one rank adds a non-zero row
        return x


class ParallelLMHead(_VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The full [T, vocab] logits on every rank: each computes its vocabulary slice and an
        all-gather puts them side by side."""
        local = nn.functional.linear(hidden, self.weight)
        t = local.shape[0]
        parts = torch.empty((self.tp * t, self.per), dtype=local.dtype, device=local.device)
        _all_gather(parts, local.contiguous(), group=self.group)
        return parts.view(self.tp, t, self.per).permute(1, 0, 2).reshape(t, self.tp * self.per)[
            :, :self.vocab]


# torch 2.13 renames all_gather_into_tensor (older releases have only that name).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def raise_shape(name: str, expected: tuple, got: Any) -> None:
    _check_shape(name, torch.Size(expected), torch.Size(tuple(got)))


# -- the transform ----------------------------------------------------------------------------
def shard_model(model: CausalLM, tp: TPState) -> None:
    """Swap `model`'s layers for rank tp.rank's parallel ones (new parameters are created on
    the current default device, e.g. meta; nothing is loaded)."""
    cfg = model.config
    check_tp_size(cfg, tp.size)
    r, n = tp.rank, tp.size
    hd = cfg.head_dim
    q_local = cfg.num_heads // n
    kv_local = kv_heads_per_rank(cfg.num_kv_heads, n)
    kv_start = kv_head_start(cfg.num_kv_heads, n, r)
    i_local = cfg.intermediate_size // n
    for mod in list(model.modules()):
        if isinstance(mod, Attention):
            mod.num_heads, mod.num_kv_heads = q_local, kv_local
            mod.q_size, mod.kv_size = q_local * hd, kv_local * hd
            full = {"q": cfg.num_heads * hd, "k": cfg.num_kv_heads * hd,
                    "v": cfg.num_kv_heads * hd}
            kv = (kv_start * hd, kv_local * hd)
            mod.qkv_proj = ColumnParallelMergedLinear(
                cfg.hidden_size, {"q": (r * q_local * hd, q_local * hd), "k": kv, "v": kv},
                full, bias=mod.qkv_proj.bias is not None)
            mod.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size,
                                           r * q_local * hd, q_local * hd, tp.group)
        elif isinstance(mod, MLP):
            cols = (r * i_local, i_local)
            full = {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}
            mod.gate_up_proj = ColumnParallelMergedLinear(
                cfg.hidden_size, {"gate": cols, "up": cols}, full, bias=False)
            mod.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                              r * i_local, i_local, tp.group)
    model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, r, n,
                                                      tp.group)
    model.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, r, n, tp.group)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def build_sharded_model(model_cls: type[CausalLM], cfg: ModelConfig, dtype: torch.dtype,
                        device: torch.device, tp: TPState) -> CausalLM:
    """Rank tp.rank's shard, built on the meta device and then materialized on `device`: no
    rank ever holds the whole model. Rotary caches are recomputed there (float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(cfg)
            shard_model(model, tp)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for mod in model.modules():  # to_empty made new Parameter objects: loaders again
        if hasattr(mod, "_load"):
            for p in mod.parameters(recurse=False):
                p.weight_loader = mod._load
    with torch.device(device):
        for mod in model.modules():
            if isinstance(mod, Attention):
                mod.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                             cfg.rope_theta, cfg.rope_scaling)
    return model.eval()


# -- process groups ---------------------------------------------------------------------------
def init_tp(rank: int, size: int, store_port: int, device: torch.device,
            timeout_s: float = 600.0) -> TPState:
    """Join the group whose rank 0 serves a TCPStore on 127.0.0.1:store_port. NCCL carries the
    tensors on CUDA, gloo on the CPU; a gloo group always carries the host-side messages."""
    # Every rank of a group is on this host: gloo's and NCCL's own sockets stay on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                            **kwargs)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else group
    return TPState(rank, size, group, cpu_group)


def leave_group(timeout_s: float) -> bool:
    """Destroy this process's group; False if that did not finish within timeout_s (a peer
    that died mid-teardown: the process then exits without it)."""
    def destroy() -> None:
        with contextlib.suppress(Exception):  # already destroyed, or a peer gone
            dist.destroy_process_group()

    t = threading.Thread(target=destroy, name="tp-leave", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def broadcast_object(obj: Any, tp: TPState) -> Any:
    """Rank 0's `obj` on every rank (pickled over the gloo group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def gather_objects(obj: Any, tp: TPState) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (in rank order); None elsewhere."""
    out = [None] * tp.size if tp.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=tp.cpu_group)
    return out


def all_min(value: int, tp: TPState) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())
