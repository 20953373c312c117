"""The nixl transport on real GPUs: a producer process registers a VRAM pool with its NIXL
agent; this process reads scattered blocks into a VRAM pool of its own (on the other GPU with
two, else on the same one), byte for byte, as a decode worker with `--transport nixl` does.

    pytest -m gpu tests/gpu/test_nixl_gpu.py -rA
"""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("nixl._api", reason="the nixl package is not installed: pip install "
                                       "'tandem[nixl]'")


def test_nixl_reads_scattered_vram_blocks_across_processes_exactly() -> None:
    from kv_patterns import as_bytes, blocks_match, nixl_producer

    from tandem.kvtransfer.nixl import NixlEndpoint

    src = "cuda:0"
    dst = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
    shape = dict(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)
    rng = random.Random(3)
    src_ids, dst_ids = rng.sample(range(64), 20), rng.sample(range(64), 20)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=nixl_producer, args=(child, src, shape, "bfloat16"))
    proc.start()
    child.close()
    endpoint = NixlEndpoint()
    try:
        desc = conn.recv()
        assert (desc.transport, desc.device_index) == ("nixl", 0)
        local = torch.zeros(desc.shape, dtype=torch.bfloat16, device=dst)
        with endpoint.connect(desc) as remote:
            remote.pull(local, src_ids, dst_ids)
        assert blocks_match(local, dst_ids, src_ids)
        untouched = sorted(set(range(64)) - set(dst_ids))
        assert not as_bytes(local)[untouched].any()
        conn.send("stop")
        assert conn.recv() is True
    finally:
        endpoint.close()
        conn.close()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert endpoint.num_registered == 0 and endpoint.num_peers == 0
