"""The nixl transport on the CPU when a pull does not simply succeed, with real NIXL agents (UCX
over the loopback device) whose transfers a wrapper holds in flight: a cancelled pull, a pull past
its deadline, a transfer NIXL cannot cancel, and a peer process that vanished. Every transfer
handle is released exactly once, and the next pull works.
"""

from __future__ import annotations

import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from nixl_pools import REPO, gated_reader, local_blocks, needs_nixl, owner_pool


@needs_nixl
def test_a_cancelled_pull_releases_its_transfer_once_and_the_next_pull_works(
        nixl_endpoints) -> None:
    from tandem.kvtransfer.nixl import PullCancelled

    owner = nixl_endpoints()
    reader, gated = gated_reader(nixl_endpoints)
    with owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        local = local_blocks(4)
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(PullCancelled):
            remote.pull(local, [1, 2], [0, 3], cancel=cancel)
        assert list(gated.released.values()) == [1]
        gated.gate.set()
        remote.pull(local, [3], [1])
        assert torch.equal(local[1], pool.tensor[3])
        assert list(gated.released.values()) == [1, 1]


@needs_nixl
def test_a_pull_past_its_deadline_times_out_and_releases_once(nixl_endpoints) -> None:
    owner = nixl_endpoints()
    reader, gated = gated_reader(nixl_endpoints)
    with owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        with pytest.raises(TimeoutError, match="deadline"):
            remote.pull(local_blocks(4), [0], [0], deadline=time.monotonic())
        assert list(gated.released.values()) == [1]


@needs_nixl
def test_a_transfer_that_cannot_be_cancelled_is_waited_for_before_the_pull_returns(
        nixl_endpoints) -> None:
    """The caller frees its destination blocks when pull raises: by then nothing may write
    into them."""
    from tandem.kvtransfer.nixl import PullCancelled

    owner = nixl_endpoints()
    reader, gated = gated_reader(nixl_endpoints, refuse_release_while_gated=True)
    with owner_pool(owner, 4) as pool, reader.connect(pool.descriptor) as remote:
        cancel = threading.Event()
        cancel.set()
        outcome: list[BaseException] = []
        returned = threading.Event()

        def run() -> None:
            try:
                remote.pull(local_blocks(4), [0], [0], cancel=cancel)
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)
            returned.set()

        t = threading.Thread(target=run)
        t.start()
        assert gated.refused.wait(30)  # cancelled, and NIXL refused to drop the transfer
        assert not returned.is_set()   # still waiting: the transfer is in flight (gated PROC)
        gated.gate.set()               # the transfer ends
        t.join()
        assert isinstance(outcome[0], PullCancelled)
        assert list(gated.released.values()) == [1]


_OWNER = textwrap.dedent("""
    import os, pickle, sys
    out = os.fdopen(os.dup(1), "wb")  # the descriptor goes here; NIXL's log lines to stderr
    os.dup2(2, 1)
    os.environ["UCX_NET_DEVICES"] = "lo"
    import torch
    sys.path.insert(0, sys.argv[1])
    from tandem.kvtransfer.pool import allocate_pool
    pool = allocate_pool(num_blocks=8, dtype=torch.float16, device="cpu", transport="nixl",
                         num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    pool.tensor.view(8, -1)[:] = torch.arange(8, dtype=torch.float16)[:, None]
    out.write(pickle.dumps(pool.descriptor))
    out.flush()
    sys.stdin.read()  # until the test closes our stdin (or kills us)
""")


@needs_nixl
def test_a_peer_process_that_vanished_fails_the_pull_instead_of_hanging(
        nixl_endpoints) -> None:
    """The owner is another process (UCX over loopback, as between two hosts' agents); once it
    is killed, a pull raises (NIXL's error, or the deadline) and releases its transfer."""
    from tandem.kvtransfer.nixl import TransferFailed

    child = subprocess.Popen([sys.executable, "-c", _OWNER, str(REPO)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        desc = pickle.load(child.stdout)
        assert desc.transport == "nixl" and desc.owner_pid == child.pid
        reader, gated = gated_reader(nixl_endpoints)
        gated.gate.set()
        remote = reader.connect(desc)
        local = local_blocks(8)
        remote.pull(local, [6, 2], [0, 1])
        assert (local[0] == 6).all() and (local[1] == 2).all()
        child.send_signal(signal.SIGKILL)
        child.wait()
        with pytest.raises((TransferFailed, TimeoutError)):
            remote.pull(local, [5], [2], deadline=time.monotonic() + 20)
        assert set(gated.released.values()) == {1}  # each transfer made released once
        assert len(gated.released) == len(gated.made)
        remote.close()
        assert reader.num_peers == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
