"""A worker's role change in place (runtime/role_switch.py), its checks on plain data: what a
worker may switch to and why not (SwitchRole refuses before draining, and the caller restarts
the worker instead), the certificates it holds for each role, the names an elastic stack gives
each worker in its other role, and the supervisor restarting a worker that refuses."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tandem.cli.certs import make_cluster_ca
from tandem.cli.launcher import Proc, _other_names
from tandem.cli.supervisor import Supervisor
from tandem.errors import InvalidArgument
from tandem.runtime.role_switch import RoleOptions, SwitchChecks, role_certificates
from tandem.v1 import worker_pb2, worker_pb2_grpc


def _engine(device="cpu", transport=None, speculative=None, dead=False):
    config = SimpleNamespace(device=device, speculative_method=speculative)
    return SimpleNamespace(dead=dead, spec=SimpleNamespace(config=config, transport=transport))


ROLES = {"prefill": RoleOptions("prefill", object), "decode": RoleOptions("decode", object)}


def _checks(engine=None, roles=ROLES, certs=None, tls=False, loopback=True):
    return SwitchChecks(engine or _engine(), roles, certs or {}, tls=tls, loopback=loopback)


def test_a_split_worker_on_loopback_switches_to_the_other_role():
    assert _checks().refusal("decode", "prefill") is None
    assert _checks().refusal("prefill", "decode") is None
    with_certs = _checks(certs={"prefill": object(), "decode": object()}, tls=True)
    assert with_certs.refusal("decode", "prefill") is None


@pytest.mark.parametrize(("checks", "current", "role", "why"), [
    (_checks(), "both", "decode", "colocated"),
    (_checks(), "decode", "decode", "a decode worker already"),
    (_checks(roles={"decode": ROLES["decode"]}), "decode", "prefill", "role is fixed"),
    (_checks(certs={"decode": object()}, tls=True), "decode", "prefill", "no certificate"),
    (_checks(_engine(dead=True)), "decode", "prefill", "engine core is gone"),
    (_checks(_engine(speculative="ngram")), "decode", "prefill", "speculative decoding"),
    (_checks(_engine(transport="tcp")), "prefill", "decode", "on tcp"),
    (_checks(roles={**ROLES, "prefill": RoleOptions("prefill", object, "tcp")}), "decode",
     "prefill", "wants tcp"),
    (_checks(loopback=False), "decode", "prefill", "loopback"),
])
def test_what_a_worker_cannot_change_in_place_is_refused_with_why(checks, current, role, why):
    assert why in checks.refusal(current, role)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_cluster_ca(tmp_path_factory.mktemp("certs"), members={
        "prefill1": "prefill", "decode1": "decode", "decode2": "decode", "router": "router"})


def _args(switch=None, key=None):
    return SimpleNamespace(cluster_switch_cert=switch, cluster_switch_key=key)


def test_a_worker_holds_its_roles_certificate_and_the_other_ones(certs):
    tls, other = certs.tls("decode1"), certs.tls("prefill1")
    held = role_certificates(_args(str(other.cert), str(other.key)), tls, "decode")
    assert set(held) == {"decode", "prefill"} and held["decode"] is tls
    assert held["prefill"].cert == other.cert and held["prefill"].ca == tls.ca
    assert role_certificates(_args(), tls, "decode") == {"decode": tls}
    assert role_certificates(_args(), None, "decode") == {}


@pytest.mark.parametrize(("member", "with_key", "tls"), [
    ("decode2", True, True),  # its own role's
    ("router", True, True),  # not a worker role
    ("prefill1", False, True),  # no key
    ("prefill1", True, False),  # without cluster TLS
])
def test_a_wrong_switch_certificate_fails_at_start_naming_the_flag(certs, member, with_key, tls):
    switch = certs.tls(member)
    args = _args(str(switch.cert), str(switch.key) if with_key else None)
    with pytest.raises(InvalidArgument) as e:
        role_certificates(args, certs.tls("decode1") if tls else None, "decode")
    assert e.value.field == "--cluster-switch-cert"


def test_each_elastic_worker_has_one_name_per_role_for_its_life():
    names = ["prefill0", "decode0", "decode1", "decode2"]
    other = _other_names(names, ["prefill", "decode", "decode", "decode"])
    assert other == {"decode2": "prefill1", "decode1": "prefill2", "decode0": "prefill3",
                     "prefill0": "decode3"}
    assert len(set(names) | set(other.values())) == 2 * len(names)  # no name held twice


class _Refusing(worker_pb2_grpc.WorkerServicer):
    """A worker that cannot change role in place: SwitchRole refused, Drain answered (and its
    process told to exit 0), every call recorded."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.calls: list[str] = []

    def SwitchRole(self, request, context):  # noqa: N802 - gRPC method name
        self.calls.append(f"SwitchRole {request.role}")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "its role is fixed")

    def Drain(self, request, context):  # noqa: N802
        self.calls.append("Drain")
        self.proc.stdin.close()  # it exits 0
        return worker_pb2.DrainResponse(moved=1)


class _Stack:
    """What the supervisor asks of an elastic LocalStack, for one worker."""

    elastic, cluster_tls, grace = True, None, 1.0

    def __init__(self, address: str) -> None:
        self.procs = {"decode1": Proc("decode1", _waiting(), Path("ready"), None, address)}
        self.files: list[str | None] = []

    def write_workers_file(self, without: str | None = None) -> None:
        self.files.append(without)

    def replace_worker(self, name: str, role: str) -> Proc:
        new = Proc(f"{role}1", _waiting(), Path("ready"), None)
        self.procs = {new.name: new}
        return new

    def read_ready(self, p: Proc) -> bool:
        p.address = "127.0.0.1:1"
        return True


def _waiting() -> subprocess.Popen:
    """A process that exits 0 once its stdin closes."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)


def test_a_worker_that_cannot_change_in_place_is_drained_and_restarted():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    stack = _Stack(f"127.0.0.1:{port}")
    worker = _Refusing(stack.procs["decode1"].popen)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    server.start()
    said: list[str] = []
    supervisor = Supervisor(stack, say=said.append).start(0.05)
    try:
        supervisor.convert("decode1", "prefill", reason="test")
        (conv,) = supervisor.wait_converted(1, timeout=60)
    finally:
        supervisor.stop()
        server.stop(0)
        for p in stack.procs.values():
            p.popen.kill()
            p.popen.wait()
    assert worker.calls == ["SwitchRole prefill", "Drain"]  # asked first, drained after
    assert conv.done and conv.exit_code == 0 and conv.new_name == "prefill1" and conv.moved == 1
    assert not conv.switched_to and conv.exited_at is not None
    assert any("cannot change role in place (its role is fixed)" in m for m in said), said
    assert stack.files == ["decode1", None]  # out of the file, then back in as prefill1
