"""Moving KV heads between tensor-parallel sizes: each decode rank ends up with exactly its
heads of each pulled block, whichever prefill ranks held them."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.parallel import rank_heads
from tandem.errors import InvalidArgument, LayoutMismatch
from tandem.kvtransfer.descriptor import PoolDescriptor, check_compatible
from tandem.kvtransfer.tp_pull import HeadCopy, head_plan, pull_heads

LAYERS, BS, DIM, BLOCKS = 2, 4, 8, 10


def rank_pools(full: torch.Tensor, heads: int, tp: int) -> list[torch.Tensor]:
    """Each rank's pool as a tensor-parallel worker of `tp` ranks holds it."""
    return [full[:, :, :, :, rank_heads(heads, tp, r).start:rank_heads(heads, tp, r).stop]
            .clone() for r in range(tp)]


@pytest.mark.parametrize(("heads", "src_tp", "dst_tp"), [
    (4, 2, 1), (4, 1, 2), (4, 2, 4), (4, 4, 2), (4, 2, 2), (2, 1, 4), (2, 4, 1), (1, 2, 1),
    (2, 4, 2)])
def test_every_decode_rank_gets_its_heads(heads, src_tp, dst_tp):
    full = torch.randn(BLOCKS, LAYERS, 2, BS, heads, DIM)
    src = rank_pools(full, heads, src_tp)
    src_ids, dst_ids = [7, 2, 5], [0, 9, 3]
    for rank in range(dst_tp):
        want = rank_heads(heads, dst_tp, rank)
        local = torch.zeros(BLOCKS, LAYERS, 2, BS, len(want), DIM)
        stats = pull_heads(src, local, heads, rank, dst_tp, src_ids, dst_ids)
        assert torch.equal(local[dst_ids], full[src_ids][:, :, :, :, want.start:want.stop])
        untouched = [b for b in range(BLOCKS) if b not in dst_ids]
        assert not local[untouched].any()
        assert stats.num_blocks == 3 and stats.bytes == local[dst_ids].numel() * 4


def test_plan_spreads_replicas_and_takes_runs_of_heads():
    # 2 KV heads over 4 prefill ranks (each replicated twice) into 1 decode rank.
    assert head_plan(2, 4, 1, 0) == [HeadCopy(0, 0, 0, 1), HeadCopy(2, 0, 1, 1)]
    # 8 heads, prefill TP 2 → decode TP 1: two runs of four.
    assert head_plan(8, 2, 1, 0) == [HeadCopy(0, 0, 0, 4), HeadCopy(1, 0, 4, 4)]
    # Decode ranks 0 and 1 of 4 read the two replicas of head 0 from different ranks.
    assert [c.src_rank for r in (0, 1) for c in head_plan(2, 4, 4, r)] == [0, 1]


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(InvalidArgument, match="tensor_parallel_size"):
        head_plan(6, 2, 3, 0)


def test_bad_block_ids_are_refused_before_any_copy():
    full = torch.randn(BLOCKS, LAYERS, 2, BS, 4, DIM)
    local = torch.zeros(BLOCKS, LAYERS, 2, BS, 4, DIM)
    with pytest.raises(InvalidArgument, match="src_block_ids"):
        pull_heads(rank_pools(full, 4, 2), local, 4, 0, 1, [BLOCKS], [0])
    with pytest.raises(InvalidArgument, match="dst_block_ids"):
        pull_heads(rank_pools(full, 4, 2), local, 4, 0, 1, [1, 2], [3, 3])
    assert not local.any()


def desc(**kw) -> PoolDescriptor:
    base = dict(dtype="float32", block_size=16, num_layers=2, num_kv_heads=2, head_dim=64,
                num_blocks=8, transport="shm", handle=b"tandem-kv-x", device_index=-1,
                owner_pid=1)
    return PoolDescriptor(**{**base, **kw})


def test_layouts_compare_the_models_heads_and_tp_sizes():
    tp1 = desc(num_kv_heads=4)
    tp2 = desc(num_kv_heads=2, model_kv_heads=4, tensor_parallel_size=2)
    check_compatible(tp1, tp2)
    check_compatible(tp2, tp1)
    with pytest.raises(LayoutMismatch, match="num_kv_heads"):
        check_compatible(desc(num_kv_heads=2), tp2)
    with pytest.raises(LayoutMismatch, match="tensor_parallel_size"):
        check_compatible(desc(num_kv_heads=2, model_kv_heads=6, tensor_parallel_size=3),
                         desc(num_kv_heads=3, model_kv_heads=6, tensor_parallel_size=2))


def test_tensor_parallel_handoffs_refuse_nixl_pools(tmp_path):
    """Heads move between tensor-parallel workers over shm or cuda_ipc; a nixl pool is refused
    by name, before any rank starts or any pool is mapped."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.tp_group import RankKV, TPGroup

    with pytest.raises(InvalidArgument, match="transport"):
        TPGroup(EngineConfig(model="m", tensor_parallel_size=2), tmp_path,
                pool_transport="nixl")
    kv = RankKV(None, 0, 2, 2)
    kv.local = torch.zeros(4, LAYERS, 2, BS, 1, DIM)
    with pytest.raises(InvalidArgument, match="transport"):
        kv.map("127.0.0.1:1", [desc(transport="nixl", handle=b"x", device_index=-1)], "i")
    assert not kv.peers
