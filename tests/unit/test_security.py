"""The pieces of the trust boundaries that need no running stack: API keys and tenants, the
cluster CA, the HTTP body checks, the strict sampling-parameter ranges, prefix-cache salts, and
`tandem up` keeping keys off command lines."""

from __future__ import annotations

import argparse
import asyncio
import math

import grpc
import pytest

from tandem.cli.certs import make_cluster_ca
from tandem.engine.block_pool import hash_block, salt_root
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.errors import InvalidArgument
from tandem.router_svc.frontend import Frontend
from tandem.router_svc.http_guard import BodyGuard
from tandem.router_svc.json_body import BodyError, check_json
from tandem.runtime.cluster_roles import (
    ROLES,
    SELF,
    WORKER_CALLERS,
    WORKER_ROLES,
    allowed,
    peer_name,
    role_of,
)
from tandem.runtime.security import ApiKeys, ClusterTls, PublicTls, load_api_keys


# -- API keys ------------------------------------------------------------------------------------
def test_each_key_is_its_own_tenant_and_a_wrong_key_none():
    keys = ApiKeys(["alpha", "beta"])
    a, b = keys.tenant(b"Bearer alpha"), keys.tenant("Bearer beta")
    assert a and b and a != b
    assert keys.tenant(b"Bearer alpha") == a  # stable
    for bad in (None, b"", b"alpha", b"Bearer alph", b"Bearer alphaa", b"Basic alpha",
                b"Beare alpha", b"Bearer"):
        assert keys.tenant(bad) is None, bad
    # The scheme is case-insensitive (RFC 7235), with one space or more after it.
    for spelt in (b"bearer alpha", b"BEARER alpha", b"bEaReR  alpha"):
        assert keys.tenant(spelt) == a, spelt
    assert "alpha" not in a  # the tenant id does not carry the key


def test_keys_come_from_the_environment_or_a_file(tmp_path):
    assert not load_api_keys({})
    assert load_api_keys({"TANDEM_API_KEY": "k1"}).tenant(b"Bearer k1")
    f = tmp_path / "keys"
    f.write_text("# tenants\nk2\n\n  k3  \n")
    keys = load_api_keys({"TANDEM_API_KEY_FILE": str(f)})
    assert keys.tenant(b"Bearer k2") and keys.tenant(b"Bearer k3")
    assert keys.tenant(b"Bearer # tenants") is None
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(InvalidArgument) as e:
        load_api_keys({}, key_file=str(tmp_path / "empty"))
    assert e.value.field == "--api-key-file"
    with pytest.raises(InvalidArgument) as e:
        load_api_keys({}, key_file=str(tmp_path / "missing"))
    assert e.value.field == "--api-key-file"


def test_the_router_and_tandem_up_take_no_key_on_the_command_line():
    from tandem.cli.main import build_parser

    for argv in (["router", "--model", "m", "--workers", "a:1", "--api-key", "secret"],
                 ["up", "--api-key", "secret"]):
        with pytest.raises(SystemExit) as e:
            build_parser(argv[0]).parse_args(argv)
        assert e.value.code == 2


def test_tandem_up_passes_the_key_file_not_the_key(monkeypatch, tmp_path):
    from tandem.cli.main import build_parser
    from tandem.cli.up import stack_from_args

    monkeypatch.setenv("TANDEM_API_KEY", "the-secret")
    args = build_parser("up").parse_args(["up", "--device", "cpu", "--api-key-file",
                                          str(tmp_path / "keys"), "--log-dir", str(tmp_path)])
    stack, _ = stack_from_args(args)
    argv = " ".join(stack.router_args + stack.worker_args)
    assert "the-secret" not in argv
    assert f"--api-key-file {tmp_path / 'keys'}" in argv
    assert stack.cluster_ca  # mutual TLS inside the stack unless --no-cluster-tls
    assert stack.env["TANDEM_API_KEY"] == "the-secret"  # the router's environment has it
    assert "TANDEM_API_KEY" not in stack.worker_env  # the workers' has not
    assert stack.worker_env["PYTHONUNBUFFERED"] == "1"


# -- certificates and roles ----------------------------------------------------------------------
def test_the_cluster_ca_signs_one_certificate_per_role(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    made = make_cluster_ca(tmp_path, ["prefill", "10.0.0.5"])
    assert set(made.members) == set(ROLES)
    assert not list(tmp_path.glob("ca.key"))  # the CA's key is never written
    ca = x509.load_pem_x509_certificate(made.ca.read_bytes())
    for role in ROLES:
        tls = made.tls(role)
        assert (tls.key.stat().st_mode & 0o777) == 0o600
        cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        # Its identity (checked by workers), its role's name (checked by callers), the hosts.
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://tandem/{role}/{role}"]
        assert {peer_name(role), "localhost", "prefill"} <= set(
            san.get_values_for_type(x509.DNSName))
        assert not {peer_name(r) for r in ROLES if r != role} & set(
            san.get_values_for_type(x509.DNSName))
        assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1",
                                                                               "10.0.0.5"}
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
        assert tls.identity() == f"spiffe://tandem/{role}/{role}"
        tls.check_role(role)
        with pytest.raises(InvalidArgument) as e:
            tls.check_role("prefill" if role != "prefill" else "decode")
        assert e.value.field == "--cluster-cert"
    assert isinstance(made.tls("router").server_credentials(), grpc.ServerCredentials)
    named = make_cluster_ca(tmp_path / "named", members={"decode7": "decode"})
    assert named.tls("decode7").identity() == "spiffe://tandem/decode/decode7"
    with pytest.raises(InvalidArgument):
        make_cluster_ca(tmp_path / "bad", members={"x": "admin"})


def test_certs_written_again_replace_what_was_there(tmp_path):
    """`tandem certs` into a folder that already holds a key readable by others, and links
    pointing elsewhere: every file is a new one (the key 0600), and nothing is written through
    a link."""
    import os

    from tandem.cli.main import build_parser

    out, elsewhere = tmp_path / "certs", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.write_text("not yours")
    (out / "decode.key").write_text("old key")
    os.chmod(out / "decode.key", 0o644)
    (out / "ca.pem").symlink_to(elsewhere)
    args = build_parser("certs").parse_args(["certs", "--out", str(out)])
    assert args.func(args) == 0
    assert (out / "decode.key").stat().st_mode & 0o777 == 0o600
    assert (out / "decode.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert not (out / "ca.pem").is_symlink() and elsewhere.read_text() == "not yours"
    (out / "decode.key").unlink()
    (out / "decode.key").symlink_to(elsewhere)
    make_cluster_ca(out)
    assert not (out / "decode.key").is_symlink() and elsewhere.read_text() == "not yours"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["ca.pem", *(f"{role}.{ext}" for role in ROLES for ext in ("pem", "key"))])


def test_tls_flags_go_together_and_name_the_missing_one(tmp_path):
    tls = make_cluster_ca(tmp_path).tls("prefill")
    ns = argparse.Namespace(cluster_ca=str(tls.ca), cluster_cert=str(tls.cert), cluster_key=None)
    with pytest.raises(InvalidArgument) as e:
        ClusterTls.from_args(ns)
    assert e.value.field == "--cluster-key"
    ns.cluster_key = str(tmp_path / "nope.key")
    with pytest.raises(InvalidArgument) as e:
        ClusterTls.from_args(ns)
    assert e.value.field == "--cluster-key"
    assert ClusterTls.from_args(argparse.Namespace()) is None
    with pytest.raises(InvalidArgument) as e:
        PublicTls.from_args(argparse.Namespace(tls_cert=str(tls.cert), tls_key=None))
    assert e.value.field == "--tls-key"


def test_the_callers_table_covers_every_worker_rpc_and_nothing_else():
    """WORKER_CALLERS is the one list of who may call what: every RPC of worker.proto has a
    row, and a method not in it (one added to the proto later) is refused to everyone."""
    from tandem.v1 import worker_pb2

    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    assert set(WORKER_CALLERS) == {m.name for m in service.methods}
    assert all(callers <= {*ROLES, SELF} and callers for callers in WORKER_CALLERS.values())
    for method, callers in WORKER_CALLERS.items():
        for role in (*ROLES, None):
            for own in WORKER_ROLES:
                assert allowed(f"/tandem.v1.Worker/{method}", role, own) == (
                    role in callers or (SELF in callers and role == own))
    # A worker is drained by a router or from its own pod (its own role's certificate), not
    # by a worker of another role.
    assert allowed("/tandem.v1.Worker/Drain", "decode", "decode")
    assert not allowed("/tandem.v1.Worker/Drain", "prefill", "decode")
    assert not allowed("/tandem.v1.Worker/SomethingNew", "router")
    assert not allowed("/tandem.v1.Tandem/Generate", "router")  # not a worker's service
    assert allowed("/grpc.health.v1.Health/Check", None)
    assert role_of("spiffe://tandem/decode/decode0") == "decode"
    for other in ("spiffe://tandem/admin/x", "spiffe://elsewhere/router/r", "router", None, ""):
        assert role_of(other) is None, other


def test_a_caller_checks_the_role_of_the_peer_it_dials(tmp_path):
    """A channel to a prefill worker accepts only a prefill worker's certificate, whatever
    address it dials: the server here listens on 127.0.0.1, which every certificate names, so
    a call that succeeds for one role and fails for another shows the role was checked. `tandem
    health` checks the name it is given (a pod dialed by an IP its certificate lacks)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from health_server import health_server

    from tandem.cli import health as healthcheck
    from tandem.runtime.security import internal_channel

    made = make_cluster_ca(tmp_path)

    async def main():
        async with health_server(made.tls("prefill")) as (address, _):
            codes = []
            for role in ("prefill", "decode", "router"):
                async with internal_channel(address, made.tls("decode"), (), role) as ch:
                    try:
                        await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(), timeout=5)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as e:
                        codes.append(e.code())
            probes = []
            for name in (peer_name("prefill"), peer_name("decode")):
                argv = ["--address", address, "--timeout", "5", *made.tls("prefill").argv(),
                        "--cluster-server-name", name]
                probes.append(await asyncio.to_thread(healthcheck.main, argv))
            return codes, probes

    codes, probes = asyncio.run(main())
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    assert probes == [0, 1]


def test_a_worker_without_cluster_tls_listens_on_loopback_unless_insecure(caplog):
    """The check runs before the engine loads: a non-loopback --host without TLS is refused
    naming --insecure; with it, or on loopback, the worker starts and says loudly that anyone
    who reaches it may call it."""
    from tandem.runtime.worker import check_exposure, is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.3.0.1"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "prefill"))
    with pytest.raises(InvalidArgument) as e:
        check_exposure(argparse.Namespace(host="0.0.0.0", port=0, insecure=False), None,
                       "decode")
    assert e.value.field == "--host" and "--insecure" in e.value.message
    for host, insecure in (("0.0.0.0", True), ("127.0.0.1", False)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            check_exposure(argparse.Namespace(host=host, port=7, insecure=insecure), None,
                           "prefill")
        assert any("NO CLUSTER TLS" in r.getMessage() for r in caplog.records), host


def test_a_pool_owner_is_known_by_the_socket_it_listens_on():
    """Without TLS, a decode worker maps a pool only when its owner (or the owner's parent, the
    worker's server) listens at the address it dialed: here this process listens, and a child
    of it stands for the engine core that owns a pool."""
    import os
    import socket
    import subprocess
    import sys

    from tandem.runtime.local_peers import pool_owner_listens

    with socket.socket() as listener, socket.socket() as other:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        other.bind(("127.0.0.1", 0))  # bound, not listening
        port, idle = listener.getsockname()[1], other.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                 stdin=subprocess.PIPE)
        try:
            assert pool_owner_listens(os.getpid(), f"127.0.0.1:{port}")
            assert pool_owner_listens(os.getpid(), f"localhost:{port}")
            assert pool_owner_listens(child.pid, f"127.0.0.1:{port}")  # its parent listens
            assert not pool_owner_listens(os.getpid(), f"127.0.0.1:{idle}")
            assert not pool_owner_listens(os.getpid(), f"127.0.0.2:{port}")  # not that address
            assert not pool_owner_listens(1, f"127.0.0.1:{port}")  # another process
        finally:
            child.stdin.close()
            child.wait()
        assert not pool_owner_listens(child.pid, f"127.0.0.1:{port}")  # gone


# -- the HTTP body -------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,needle", [
    (b'{"temperature": NaN}', "temperature", "finite"),
    (b'{"a": {"b": [1, -Infinity]}}', "a", "a.b[1]"),
    (b'{"x": 1e400}', "x", "finite"),
    (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
    (b'{"\\udc00": 1}', None, "surrogate"),
    (b'\xc3\x28', None, "UTF-8"),
    (b'[' * 70 + b']' * 70, None, "deeply"),
    (b'[' * 200_000 + b']' * 200_000, None, "deeply"),
    (b'{"a": ', None, "JSON"),
])
def test_check_json_refuses_what_json_does_not_allow(body, param, needle):
    with pytest.raises(BodyError) as e:
        check_json(body)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message


def test_check_json_passes_ordinary_bodies():
    assert check_json(b'{"prompt": "caf\xc3\xa9 \\ud83d\\ude00", "t": 0.5, "l": [[1]]}') == {
        "prompt": "café 😀", "t": 0.5, "l": [[1]]}


def _asgi_call(app, body_chunks: list[bytes], headers: list[tuple[bytes, bytes]]):
    sent: list[dict] = []
    chunks = list(body_chunks)

    async def receive():
        if chunks:
            c = chunks.pop(0)
            return {"type": "http.request", "body": c, "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent


def test_the_body_limit_answers_413_without_reading_the_body():
    reached = []

    async def inner(scope, receive, send):
        reached.append((await receive())["body"])

    def respond(status, message, param, code):
        async def app(scope, receive, send):
            await send({"type": "response", "status": status, "code": code})
        return app

    guard = BodyGuard(inner, max_bytes=100, respond=respond, takes_body=lambda _: True)
    # Declared too long: refused before a byte is read.
    sent = _asgi_call(guard, [b"x" * 1000], [(b"content-length", b"1000")])
    assert sent == [{"type": "response", "status": 413, "code": "request_too_large"}]
    # No length given (chunked): refused once the bytes read pass the limit.
    sent = _asgi_call(guard, [b"{" + b" " * 60, b" " * 60 + b"}"], [])
    assert sent[0]["status"] == 413 and not reached
    # Within the limit: handed on unchanged.
    assert _asgi_call(guard, [b'{"a":', b' 1}'], []) == [] and reached == [b'{"a": 1}']


# -- numeric fields ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,field", [
    ({"temperature": math.nan}, "temperature"), ({"top_p": math.nan}, "top_p"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"temperature": math.inf}, "temperature"), ({"min_p": -math.inf}, "min_p"),
    ({"max_tokens": 2**32}, "max_tokens"), ({"top_k": 2**32}, "top_k"),
    ({"n": 2**64}, "n"), ({"stop_token_ids": [2**32]}, "stop_token_ids"),
    ({"logit_bias": {2**32: 1.0}}, "logit_bias"), ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": "0.5"}, "temperature"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"cache_salt": "x" * 257}, "cache_salt"),
    ({"stop": ["s"] * 257}, "stop"), ({"stop": ["s" * 4097]}, "stop"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
])
def test_sampling_params_refuse_values_outside_their_ranges(kw, field):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kw)
    assert e.value.field == field


# -- prefix-cache namespaces ---------------------------------------------------------------------
def test_a_salt_changes_every_block_hash_of_the_prompt():
    prompt = list(range(48))

    def hashes(salt: str) -> list[int]:
        return Sequence("r", prompt, SamplingParams(cache_salt=salt)).full_block_hashes(16, 48)

    plain, a, b = hashes(""), hashes("a"), hashes("b")
    assert plain[0] == hash_block(None, prompt[:16])  # unsalted: as before
    assert len({*plain, *a, *b}) == 9  # no block shared across namespaces
    assert hashes("a") == a and salt_root("a") != salt_root("b")


def test_tenants_and_salts_make_separate_namespaces():
    p = SamplingParams()
    assert Frontend.for_tenant(p, "") is p  # no keys, no salt: the one shared namespace
    spaces = {Frontend.for_tenant(SamplingParams(cache_salt=s), t).cache_salt
              for t in ("", "tenant-a", "tenant-b") for s in ("", "x")}
    assert len(spaces) == 6 and "" in spaces
    assert Frontend.for_tenant(SamplingParams(cache_salt="x"), "t").cache_salt != "x"


def test_request_ids_are_random():
    ids = {Frontend.new_request_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == len("req-") + 32 for i in ids)
