"""kvtransfer's cuda_ipc transport on real GPUs.

A producer process allocates a cuda_ipc pool, fills every block with a known pattern, hands
over its descriptor and lives until the module is done. This process opens the pool over CUDA
IPC, on the producer's GPU and (gpu2) on the other one, and checks the pulled bytes exactly.

    pytest -m gpu tests/gpu/test_kvtransfer_gpu.py -rA -s

`-s` shows the recorded answer of test_ipc_between_processes_that_each_see_one_gpu (can a
process that sees only GPU 1 open a pool of a process that sees only GPU 0, as with one GPU
per docker-compose service?). It is also a junit property.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tandem.kernels.copy_blocks import copy_blocks
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import allocate_pool
from tandem.kvtransfer.remote import launch_pull, open_remote_pool, pull_blocks

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)  # 32 KiB blocks in bf16
BLOCK_SHAPE = (SHAPE["num_layers"], 2, SHAPE["block_size"], SHAPE["num_kv_heads"],
               SHAPE["head_dim"])
NUM_BLOCKS = 96
DTYPE = torch.bfloat16

# Block b holds (b * 1009 + i) % 251 at flat index i: exact in bf16, different in every block.
_PRODUCER = textwrap.dedent("""
    import json, pickle, sys, torch
    from tandem.kvtransfer.pool import allocate_pool
    cfg = json.loads(sys.argv[1])
    pool = allocate_pool(device="cuda:0", transport="cuda_ipc", dtype=torch.bfloat16,
                         num_blocks=cfg["num_blocks"], **cfg["shape"])
    flat = pool.tensor.view(cfg["num_blocks"], -1)
    b = torch.arange(flat.shape[0], device=flat.device)[:, None]
    i = torch.arange(flat.shape[1], device=flat.device)
    flat.copy_((b * 1009 + i) % 251)
    torch.cuda.synchronize()
    sys.stdout.buffer.write(pickle.dumps(pool.descriptor))
    sys.stdout.flush()
    sys.stdin.buffer.read()  # until the test closes our stdin
    del flat, b, i  # views of the pool: the memory goes with the last one
    pool.close()
    print("closed", pool.mapped, file=sys.stderr)
""")


def _expected(block_ids: list[int]) -> torch.Tensor:
    """What the producer wrote into `block_ids`, on the CPU."""
    b = torch.tensor(block_ids)[:, None]
    i = torch.arange(math.prod(BLOCK_SHAPE))
    return ((b * 1009 + i) % 251).to(DTYPE).view(len(block_ids), *BLOCK_SHAPE)


def _env(visible: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def _physical(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's device `index`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index] if visible else str(index)


class Producer:
    """A process that owns a pattern-filled cuda_ipc pool until stop()."""

    def __init__(self, visible: str | None = None) -> None:
        cfg = json.dumps({"num_blocks": NUM_BLOCKS, "shape": SHAPE})
        self.proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, cfg], cwd=REPO,
                                     env=_env(visible), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdout is not None
        try:
            self.descriptor: PoolDescriptor = pickle.load(self.proc.stdout)
        except EOFError:
            _, err = self.proc.communicate(timeout=60)
            raise RuntimeError(f"producer died: {err.decode()[-3000:]}") from None

    def stop(self) -> str:
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err.decode()
        return err.decode()


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    """Sees the GPUs this process sees, owns its pool on GPU 0."""
    p = Producer()
    yield p
    assert "closed False" in p.stop()  # the owner freed its allocation


def _scattered(n: int, limit: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(limit), n)  # distinct, not monotonic


def test_descriptor_from_another_process(producer: Producer) -> None:
    desc = producer.descriptor
    assert (desc.transport, desc.device_index, len(desc.handle)) == ("cuda_ipc", 0, 64)
    assert desc.owner_pid == producer.proc.pid != os.getpid()
    assert desc.handle.hex() not in repr(desc)


def test_open_on_the_same_gpu_reads_the_owners_bytes(producer: Producer) -> None:
    remote = open_remote_pool(producer.descriptor, "cuda:0")
    assert remote.tensor.device == torch.device("cuda:0")
    assert remote.tensor.shape == producer.descriptor.shape and remote.tensor.dtype == DTYPE
    ids = [0, NUM_BLOCKS - 1, *_scattered(20, NUM_BLOCKS, seed=1)]
    got = remote.tensor.index_select(0, torch.tensor(ids, device="cuda:0"))
    assert torch.equal(got.cpu(), _expected(ids))
    remote.close()
    assert not remote.mapped  # no view left: ipcCloseMemHandle ran


def test_pull_blocks_same_gpu_scattered_ids(producer: Producer) -> None:
    remote = open_remote_pool(producer.descriptor, "cuda:0")
    local = allocate_pool(num_blocks=64, dtype=DTYPE, device="cuda:0", transport="cuda_ipc",
                          **SHAPE)
    local.tensor.fill_(-1)
    src, dst = _scattered(40, NUM_BLOCKS, seed=2), _scattered(40, 64, seed=3)
    stats = pull_blocks(remote, local.tensor, src, dst)
    assert stats.num_blocks == 40 and stats.bytes == 40 * producer.descriptor.block_bytes
    got = local.tensor.cpu()
    assert torch.equal(got[dst], _expected(src))
    untouched = sorted(set(range(64)) - set(dst))
    assert (got[untouched] == -1).all()
    # Pull again into the same blocks from other sources: the ids, not the order, decide.
    src2 = list(reversed(src))
    pull_blocks(remote, local.tensor, src2, dst)
    assert torch.equal(local.tensor.cpu()[dst], _expected(src2))
    remote.close()
    local.close()
    assert not remote.mapped and not local.mapped


def _runs() -> tuple[list[int], list[int]]:
    """40 pairs in three runs: ascending on both sides, descending on both, ascending again."""
    src = [*range(10, 25), *range(60, 45, -1), *range(80, 90)]
    dst = [*range(0, 15), *range(40, 25, -1), *range(50, 60)]
    return src, dst


def test_pull_blocks_moves_runs_on_the_copy_engines(producer: Producer, monkeypatch) -> None:
    """A pull of a few runs of adjacent blocks is one cudaMemcpyAsync per run: the kernel is
    not even loaded (it raises here), and the bytes land exactly."""
    import tandem.kvtransfer.remote as remote_mod

    def no_kernel():
        raise AssertionError("a pull of 3 runs launched the copy_blocks kernel")

    monkeypatch.setattr(remote_mod, "_copy_blocks_kernel", no_kernel)
    remote = open_remote_pool(producer.descriptor, "cuda:0")
    local = allocate_pool(num_blocks=64, dtype=DTYPE, device="cuda:0", transport="cuda_ipc",
                          **SHAPE)
    local.tensor.fill_(-1)
    src, dst = _runs()
    stats = pull_blocks(remote, local.tensor, src, dst)
    assert stats.num_blocks == 40
    got = local.tensor.cpu()
    assert torch.equal(got[dst], _expected(src))
    assert (got[sorted(set(range(64)) - set(dst))] == -1).all()
    remote.close()
    local.close()


@pytest.mark.parametrize("ids", ["scattered", "runs"])
def test_launch_pull_runs_in_stream_order(producer: Producer, ids: str) -> None:
    """launch_pull returns without waiting; the copy (the kernel for scattered ids, the copy
    engines for runs) runs after the work already on the stream (a write to the same blocks,
    as a step in flight writing blocks freed since) and before work launched later (the next
    step reading them); done() and the device time after.

    Everything that may synchronise the device (the kernel's first load, a new pinned-memory
    size class, uploads) happens before the stream is held busy; after it, only launches."""
    remote = open_remote_pool(producer.descriptor, "cuda:0")
    local = allocate_pool(num_blocks=64, dtype=DTYPE, device="cuda:0", transport="cuda_ipc",
                          **SHAPE)
    src, dst = ((_scattered(40, NUM_BLOCKS, seed=4), _scattered(40, 64, seed=5))
                if ids == "scattered" else _runs())
    launch_pull(remote, local.tensor, src, dst).wait()  # warm: kernel loaded, pinned ids
    stray = torch.full((40, *BLOCK_SHAPE), 3, dtype=DTYPE, device="cuda:0")
    seen = torch.zeros_like(stray)
    rows = torch.arange(40, device="cuda:0")
    idx = torch.tensor(dst, device="cuda:0")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # hold the stream busy: the launch must not wait for it
    copy_blocks(stray, local.tensor, rows, idx)  # the stray write, before the pull
    pending = launch_pull(remote, local.tensor, src, dst)
    copy_blocks(local.tensor, seen, idx, rows)  # the next step's read, after the pull
    assert not pending.done()
    pending.wait()
    torch.cuda.synchronize()
    assert pending.done() and torch.equal(seen.cpu(), _expected(src))
    stats = pending.stats()
    assert stats.num_blocks == 40 and stats.bytes == 40 * producer.descriptor.block_bytes
    assert 0 < stats.seconds < 1
    remote.close()
    local.close()


def test_cuda_ipc_pool_memory_is_returned_on_close() -> None:
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    pool = allocate_pool(num_blocks=8192, dtype=DTYPE, device="cuda:0", transport="cuda_ipc",
                         **SHAPE)  # 256 MiB, outside torch's caching allocator
    free_during, _ = torch.cuda.mem_get_info(0)
    assert free_before - free_during >= pool.descriptor.pool_bytes
    pool.close()
    assert not pool.mapped
    free_after, _ = torch.cuda.mem_get_info(0)
    assert free_after - free_during >= pool.descriptor.pool_bytes


@pytest.mark.gpu2
def test_pull_blocks_from_the_other_gpu(producer: Producer) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    remote = open_remote_pool(producer.descriptor, "cuda:1")  # producer's memory is on GPU 0
    assert remote.tensor.device == torch.device("cuda:1")
    ids = _scattered(30, NUM_BLOCKS, seed=4)
    got = remote.tensor.index_select(0, torch.tensor(ids, device="cuda:1"))  # torch over peer
    assert torch.equal(got.cpu(), _expected(ids))
    local = torch.full((50, *BLOCK_SHAPE), -1, dtype=DTYPE, device="cuda:1")
    dst = _scattered(30, 50, seed=5)
    stats = pull_blocks(remote, local, ids, dst)
    assert torch.equal(local.cpu()[dst], _expected(ids))
    assert (local.cpu()[sorted(set(range(50)) - set(dst))] == -1).all()
    print(f"\n[kvtransfer] {torch.cuda.get_device_name(1)}: pulled {stats.num_blocks} blocks "
          f"GPU0->GPU1 ({stats.bytes} B) in {stats.seconds * 1e6:.0f} us, first call")
    del got
    remote.close()
    assert not remote.mapped


# Sees one GPU only; opens the pool on it, reads it with torch and with pull_blocks, and
# reports what happened (as JSON on stdout) instead of raising.
_ISOLATED_CONSUMER = textwrap.dedent("""
    import json, pickle, sys, torch
    from tandem.kvtransfer.remote import open_remote_pool, pull_blocks
    desc, src, dst = pickle.load(sys.stdin.buffer)
    out = {"device_count": torch.cuda.device_count(), "card": torch.cuda.get_device_name(0)}
    data = {}
    def attempt(name, fn):
        try:
            data[name] = fn()
            torch.cuda.synchronize()
            out[name] = "ok"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
            return None
        return data[name]
    remote = attempt("open", lambda: open_remote_pool(desc, "cuda:0"))
    if remote is not None:
        ids = torch.tensor(src, device="cuda:0")
        attempt("read", lambda: remote.tensor.index_select(0, ids).cpu())
        local = torch.full((len(dst) + 8, *desc.shape[1:]), -1, dtype=remote.tensor.dtype,
                           device="cuda:0")
        attempt("pull", lambda: (pull_blocks(remote, local, src, dst), local[dst].cpu())[1])
    sys.stdout.buffer.write(pickle.dumps((out, data.get("read"), data.get("pull"))))
""")


@pytest.mark.gpu2
def test_ipc_between_processes_that_each_see_one_gpu(
        record_property: Callable[[str, object], None]) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    owner = Producer(_physical(0))  # CUDA_VISIBLE_DEVICES=<GPU 0>
    try:
        src, dst = _scattered(24, NUM_BLOCKS, seed=6), _scattered(24, 32, seed=7)
        consumer = subprocess.run(
            [sys.executable, "-c", _ISOLATED_CONSUMER], cwd=REPO, env=_env(_physical(1)),
            input=pickle.dumps((owner.descriptor, src, dst)), capture_output=True, timeout=300)
    finally:
        owner.stop()
    assert consumer.returncode == 0, consumer.stderr.decode()[-3000:]
    out, read, pulled = pickle.loads(consumer.stdout)
    answer = ("works" if out.get("open") == "ok" and out.get("read") == "ok" else "does not work")
    record_property("ipc_with_one_visible_gpu_per_process", json.dumps(out))
    print(f"\n[kvtransfer] CUDA IPC between processes with CUDA_VISIBLE_DEVICES={_physical(0)} "
          f"and ={_physical(1)}: {answer}\n  {json.dumps(out)}")
    assert out["device_count"] == 1
    # Whatever the answer, it must never be silent corruption or a leaked handle.
    for text in out.values():
        assert owner.descriptor.handle.hex() not in str(text)
    if read is not None:
        assert torch.equal(read, _expected(src))
    if pulled is not None:
        assert torch.equal(pulled, _expected(src))


def test_a_process_cannot_open_its_own_pool_and_the_error_hides_the_handle() -> None:
    """Last in the file: it leaves a failed CUDA call behind in this process."""
    with allocate_pool(num_blocks=4, dtype=DTYPE, device="cuda:0", transport="cuda_ipc",
                       **SHAPE) as own:
        try:
            remote = open_remote_pool(own.descriptor, "cuda:0")
        except RuntimeError as e:
            assert "cuda_ipc" in str(e) and own.descriptor.handle.hex() not in str(e)
            print(f"\n[kvtransfer] opening one's own pool: {e}")
        else:  # some drivers may allow it; then it must be the same bytes
            own.tensor.view(4, -1)[:, 0] = torch.arange(4, dtype=DTYPE, device="cuda:0")
            torch.cuda.synchronize()
            assert remote.tensor.view(4, -1)[:, 0].tolist() == [0, 1, 2, 3]
            remote.close()
