"""Staged NIXL reads on the CPU (kvtransfer/nixl_staging.py), with real NIXL agents over the
loopback device: which pulls are staged, the blocks landing exactly through more chunks than
the staging area has slots, one descriptor per source run in each READ, and a cancelled or
failed staged pull releasing every transfer it posted, once.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from nixl_pools import gated_reader, local_blocks, needs_nixl, owner_pool

from kvtransfer.nixl_staging import MAX_DIRECT_RUNS, Staging


def test_only_pulls_into_scattered_blocks_from_few_source_runs_are_staged() -> None:
    staging = Staging(local_blocks(4), num_blocks=8, slots=4)
    assert (staging.num_blocks, staging.chunk) == (8, 2)
    src = list(range(40, 72))
    scattered = random.Random(0).sample(range(200), 32)
    assert staging.wants(src, scattered)  # one source run, 32 destination pieces
    assert not staging.wants(src, list(range(100, 132)))  # one run: direct
    runs8 = [b for r in range(MAX_DIRECT_RUNS) for b in range(10 * r, 10 * r + 4)]
    assert not staging.wants(src, runs8)  # 8 runs: direct
    assert not staging.wants(scattered, src)  # the source as scattered: staging saves nothing
    assert not staging.wants([], [])


def test_the_area_is_capped_in_bytes_and_keeps_a_block_per_slot() -> None:
    like = local_blocks(4)
    block_bytes = like[0].numel() * like.element_size()
    assert Staging(like, num_blocks=64, slots=4, max_bytes=10 * block_bytes).num_blocks == 8
    assert Staging(like, num_blocks=64, slots=4, max_bytes=1).num_blocks == 4


class _Counting:
    """A real agent recording each transfer's descriptor count (local side)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.sizes: list[int] = []  # local, remote, local, remote, ...
        self.released = 0

    def __getattr__(self, name):
        return getattr(self.agent, name)

    @property
    def local_descs(self) -> list[int]:
        return self.sizes[0::2]

    def get_xfer_descs(self, rows, mem):
        self.sizes.append(len(rows))
        return self.agent.get_xfer_descs(rows, mem)

    def release_xfer_handle(self, handle):
        self.agent.release_xfer_handle(handle)
        self.released += 1


@needs_nixl
def test_a_staged_pull_lands_every_block_exactly_through_reused_slots(nixl_endpoints) -> None:
    owner = nixl_endpoints()
    reader = nixl_endpoints(_Counting)
    agent = reader.agent
    with owner_pool(owner, 48, torch.bfloat16) as pool, \
            reader.connect(pool.descriptor) as remote:
        local = local_blocks(40, torch.bfloat16)
        staging = Staging(local, num_blocks=8, slots=4)  # 4 slots of 2 blocks
        src = [*range(10, 23), *range(30, 26, -1)]  # 17 blocks: an ascending, a descending run
        dst = random.Random(1).sample(range(40), len(src))
        remote.pull(local, src, dst, staging=staging)
        assert staging.staged_reads == 1
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(local[d], pool.tensor[s]), (s, d)
        untouched = sorted(set(range(40)) - set(dst))
        assert (local[untouched] == -1).all()
        # 9 READs of <= 2 blocks: a chunk within one source run is one descriptor (the
        # descending one too: the slot is ordered like it), the chunk across the turn (22, 30) two
        assert len(agent.local_descs) == 9 and max(agent.local_descs) <= 2
        assert sum(agent.local_descs) == 10
        assert agent.released == 9
        # into adjacent blocks it goes direct: one READ
        agent.sizes.clear()
        remote.pull(local, list(range(12)), list(range(12)), staging=staging)
        assert staging.staged_reads == 1 and agent.local_descs == [1]
        staging.close(reader)
        assert reader.num_registered == 1  # the local pool's registration; staging's is gone


@needs_nixl
@pytest.mark.parametrize("how", ["cancel", "fail"])
def test_a_staged_pull_that_stops_releases_every_transfer_once(nixl_endpoints, how) -> None:
    """A cancel while the READs are held in flight, or NIXL refusing to post the third:
    the pull raises, every transfer posted is released exactly once, and the next staged pull
    works."""
    from kvtransfer.nixl import PullCancelled, TransferFailed

    owner = nixl_endpoints()
    reader, gated = gated_reader(nixl_endpoints)
    with owner_pool(owner, 48, torch.float16) as pool, \
            reader.connect(pool.descriptor) as remote:
        local = local_blocks(40)
        staging = Staging(local, num_blocks=8, slots=4)
        src = list(range(16))
        dst = random.Random(2).sample(range(40), 16)
        cancel = threading.Event()
        if how == "cancel":
            cancel.set()
            expected = PullCancelled
        else:
            gated.gate.set()
            posted = gated.agent.transfer
            calls = []

            def third_fails(handle):
                calls.append(handle)
                if len(calls) == 3:
                    raise RuntimeError("NIXL_ERR_BACKEND")
                return posted(handle)

            gated.agent = _Patched(gated.agent, transfer=third_fails)
            expected = TransferFailed
        with pytest.raises(expected):
            remote.pull(local, src, dst, staging=staging, cancel=cancel)
        assert len(gated.made) >= 1
        assert set(gated.released.values()) == {1} and len(gated.released) == len(gated.made)
        gated.gate.set()
        if how == "fail":
            gated.agent = gated.agent.agent
        remote.pull(local, src, dst, staging=staging)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(local[d], pool.tensor[s])
        staging.close(reader)


class _Patched:
    def __init__(self, agent, **methods) -> None:
        self.agent = agent
        self.methods = methods

    def __getattr__(self, name):
        return self.methods.get(name) or getattr(self.agent, name)


@needs_nixl
def test_a_decode_core_stages_a_pull_into_scattered_blocks_and_settles_its_lease(
        nixl_endpoints, monkeypatch) -> None:
    """engine/serving/kv_pulls.py: mapping a nixl pool makes the staging area; a pull of one
    source run into scattered blocks goes through it, lands exactly, and its one LeaseDone
    says so; a pull into adjacent blocks does not; close() deregisters the area."""
    import time
    from types import SimpleNamespace

    from engine.sequence import RemoteKV
    from engine.serving.core_messages import MapPool
    from engine.serving.kv_pulls import KVPulls
    from kvtransfer import nixl

    monkeypatch.setattr(nixl, "_default", None)  # this test's own process endpoint
    owner = nixl_endpoints()
    sent = []
    with owner_pool(owner, 48, torch.float16) as pool:
        local = local_blocks(80)
        engine = SimpleNamespace(runner=SimpleNamespace(pool=local, device="cpu"),
                                 tp_group=None)
        kp = KVPulls(engine, SimpleNamespace(peers={}), SimpleNamespace(send=sent.append))
        kp.map(MapPool("p:1", pool.descriptor, "inst"))
        reader = nixl._default
        try:
            assert kp.staging is not None and kp.staging.tensor.shape[1:] == local.shape[1:]
            src = list(range(5, 37))
            dst = random.Random(4).sample(range(80), 32)
            for i, d_ids in enumerate((dst, list(range(40, 72)))):
                kv = RemoteKV("p:1", f"L{i}", time.monotonic() + 60, tuple(src), (7,), (None,),
                              instance_id="inst")
                kp.hold(kv, f"r{i}")
                kp.pull(kv, src, d_ids)
                for s, d in zip(src, d_ids, strict=True):
                    assert torch.equal(local[d], pool.tensor[s])
            staged, direct = sent
            assert (staged.error, staged.staged, staged.num_blocks) == (None, True, 32)
            assert (direct.error, direct.staged, direct.num_runs) == (None, False, 1)
            assert (kp.pulls_staged, kp.runs_pulled, kp.blocks_pulled) == (1, staged.num_runs + 1,
                                                                           64)
            assert staged.seconds > 0 and direct.seconds > 0
            assert kp.pull_seconds == pytest.approx(staged.seconds + direct.seconds)
        finally:
            kp.close()
            assert reader.num_registered == 1  # the engine's pool; the staging area is gone
            reader.close()
