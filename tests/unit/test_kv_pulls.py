"""The decode core's pulls (engine/serving/kv_pulls.py): a pull over CUDA IPC is launched in the
engine's stream order and its lease settled only once the copy is done (poll, flush), exactly
once; other transports settle at once; which pulls may start beside a step in flight. NIXL pulls
polled by the engine are in test_nixl_pulls.py. CUDA's launch is
replaced by a stand-in here (tests/gpu run the real one)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tandem.engine.sequence import RemoteKV
from tandem.engine.serving.kv_pulls import KVPulls
from tandem.kvtransfer.remote import TransferStats


class FakeLaunch:
    """launch_pull's stand-in: records launches; each copy is done when the test says so."""

    def __init__(self) -> None:
        self.launched: list[FakePending] = []

    def __call__(self, pool, local, src, dst):
        p = FakePending(len(src))
        self.launched.append(p)
        return p


class FakePending:
    """A launched copy (kvtransfer/remote.py PendingPull): a Transfer in the stream's order."""

    outside_stream = False

    def __init__(self, n: int) -> None:
        self.n, self.finished, self.waited = n, False, False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.waited = self.finished = True

    def stats(self) -> TransferStats:
        assert self.finished
        return TransferStats(self.n, self.n * 1024, 0.002)


class Events:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def _pulls(transport: str) -> tuple[KVPulls, Events]:
    engine = SimpleNamespace(runner=SimpleNamespace(pool="local-pool", device="cuda:0"),
                             tp_group=None)
    events = Events()
    kp = KVPulls(engine, SimpleNamespace(peers={}), events)
    kp.peers["p:1"] = ("inst", SimpleNamespace(descriptor=SimpleNamespace(transport=transport)))
    return kp, events


def _lease(i: int, address: str = "p:1") -> RemoteKV:
    return RemoteKV(address, f"L{i}", time.monotonic() + 60, (1, 2, 3), (7,), (None,),
                    instance_id="inst")


def test_cuda_ipc_pulls_settle_when_their_copy_is_done(monkeypatch):
    launch = FakeLaunch()
    monkeypatch.setattr("tandem.kvtransfer.remote.launch_pull", launch)
    kp, events = _pulls("cuda_ipc")
    leases = [_lease(i) for i in range(3)]
    for i, kv in enumerate(leases):
        kp.hold(kv, f"r{i}")
        kp.pull(kv, [1, 2], [5, 6] if i < 2 else [6, 5])  # one run, one run, two
    assert len(launch.launched) == 3 and events.sent == []  # launched, nothing settled
    kp.poll()
    assert events.sent == []
    launch.launched[1].finished = True
    kp.poll()  # in launch order: the second waits behind the first
    assert events.sent == []
    launch.launched[0].finished = True
    kp.poll()
    assert [m.request_id for m in events.sent] == ["r0", "r1"]
    assert all(m.pulled and m.num_blocks == 2 and m.num_runs == 1 and m.nbytes == 2048
               and m.seconds == 0.002 and m.transport == "cuda_ipc" and m.error is None
               for m in events.sent)
    kp.flush()  # waits for the third
    assert launch.launched[2].waited
    assert [m.request_id for m in events.sent] == ["r0", "r1", "r2"]
    kp.flush()
    kp.poll()
    assert len(events.sent) == 3 and not kp.pulls and not kp.leases_held
    assert kp.blocks_pulled == 6 and kp.runs_pulled == 4 and events.sent[2].num_runs == 2
    assert kp.pull_seconds == pytest.approx(sum(e.seconds for e in events.sent))


def test_close_and_a_new_mapping_wait_for_copies_in_flight(monkeypatch):
    launch = FakeLaunch()
    monkeypatch.setattr("tandem.kvtransfer.remote.launch_pull", launch)
    kp, events = _pulls("cuda_ipc")
    kp.hold(_lease(0), "r0")
    kp.pull(_lease(0), [1], [2])
    kp.close()
    assert launch.launched[0].waited and [m.request_id for m in events.sent] == ["r0"]


def test_a_failed_check_settles_at_once_with_its_error(monkeypatch):
    launch = FakeLaunch()
    monkeypatch.setattr("tandem.kvtransfer.remote.launch_pull", launch)
    kp, events = _pulls("cuda_ipc")
    stale = RemoteKV("p:1", "L9", time.monotonic() - 1, (1,), (7,), (None,), instance_id="inst")
    kp.hold(stale, "r9")
    with pytest.raises(TimeoutError):
        kp.pull(stale, [1], [2])
    assert not launch.launched and events.sent[0].error.startswith("TimeoutError")
    kp.flush()
    assert len(events.sent) == 1


def test_which_pulls_may_start_beside_a_step_in_flight():
    for transport in ("cuda_ipc", "shm", "nixl"):  # nixl: posted once the stream passed it
        kp, _ = _pulls(transport)
        assert kp.in_stream(_lease(0)) is True, transport
        assert kp.in_stream(_lease(0, address="unmapped:2")) is False
    kp, _ = _pulls("cuda_ipc")
    kp.rank_kv.peers["p:1"] = ("inst", [])  # heads moved between tensor-parallel sizes
    assert kp.in_stream(_lease(0)) is False
