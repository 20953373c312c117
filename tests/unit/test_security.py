"""The pieces of the trust boundaries that need no running stack: API keys and tenants, the
cluster CA, the HTTP body checks, the strict sampling-parameter ranges, prefix-cache salts, and
`tandem up` keeping keys off command lines."""

from __future__ import annotations

import argparse
import asyncio
import math

import grpc
import pytest

from cli.certs import make_cluster_ca
from engine.block_pool import hash_block, salt_root
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from router_svc.frontend import Frontend
from router_svc.http_guard import BodyGuard
from router_svc.json_body import BodyError, check_json
from runtime.security import ApiKeys, ClusterTls, PublicTls, load_api_keys
from tandem.errors import InvalidArgument


# -- API keys ------------------------------------------------------------------------------------
def test_each_key_is_its_own_tenant_and_a_wrong_key_none():
    keys = ApiKeys(["alpha", "beta"])
    a, b = keys.tenant(b"Bearer alpha"), keys.tenant("Bearer beta")
    assert a and b and a != b
    assert keys.tenant(b"Bearer alpha") == a  # stable
    for bad in (None, b"", b"alpha", b"Bearer alph", b"Bearer alphaa", b"bearer alpha"):
        assert keys.tenant(bad) is None, bad
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
    from cli.main import build_parser

    for argv in (["router", "--model", "m", "--workers", "a:1", "--api-key", "secret"],
                 ["up", "--api-key", "secret"]):
        with pytest.raises(SystemExit) as e:
            build_parser(argv[0]).parse_args(argv)
        assert e.value.code == 2


def test_tandem_up_passes_the_key_file_not_the_key(monkeypatch, tmp_path):
    from cli.main import build_parser
    from cli.up import stack_from_args

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


# -- certificates --------------------------------------------------------------------------------
def test_the_cluster_ca_signs_a_node_certificate_for_both_ends(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    tls = make_cluster_ca(tmp_path, ["prefill", "10.0.0.5"])
    assert (tls.key.stat().st_mode & 0o777) == 0o600
    assert not list(tmp_path.glob("ca.key"))  # the CA's key is never written
    ca = x509.load_pem_x509_certificate(tls.ca.read_bytes())
    node = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    node.verify_directly_issued_by(ca)
    san = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "prefill"} <= set(san.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1",
                                                                           "10.0.0.5"}
    usage = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    assert isinstance(tls.server_credentials(), grpc.ServerCredentials)


def test_certs_written_again_replace_what_was_there(tmp_path):
    """`tandem certs` into a folder that already holds a key readable by others, and links
    pointing elsewhere: every file is a new one (the key 0600), and nothing is written through
    a link."""
    import os

    from cli.main import build_parser

    out, elsewhere = tmp_path / "certs", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.write_text("not yours")
    (out / "node.key").write_text("old key")
    os.chmod(out / "node.key", 0o644)
    (out / "ca.pem").symlink_to(elsewhere)
    args = build_parser("certs").parse_args(["certs", "--out", str(out)])
    assert args.func(args) == 0
    assert (out / "node.key").stat().st_mode & 0o777 == 0o600
    assert (out / "node.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert not (out / "ca.pem").is_symlink() and elsewhere.read_text() == "not yours"
    (out / "node.key").unlink()
    (out / "node.key").symlink_to(elsewhere)
    make_cluster_ca(out)
    assert not (out / "node.key").is_symlink() and elsewhere.read_text() == "not yours"
    assert sorted(p.name for p in out.iterdir()) == ["ca.pem", "node.key", "node.pem"]


def test_tls_flags_go_together_and_name_the_missing_one(tmp_path):
    tls = make_cluster_ca(tmp_path)
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



def test_a_cluster_server_name_is_what_a_peer_certificate_must_carry(tmp_path):
    """Kubernetes dials pods by IPs no certificate names: with --cluster-server-name every
    internal call (and `tandem health`) checks that name instead of the dialed host. The server
    here listens on 127.0.0.1, which the certificate also names, so a call that succeeds with
    the right name and fails with a wrong one shows the name, not the address, was checked."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from health_server import health_server

    from cli import health as healthcheck
    from runtime.security import internal_channel

    made = make_cluster_ca(tmp_path, ["tandem-cluster"])
    ns = argparse.Namespace(cluster_ca=str(made.ca), cluster_cert=str(made.cert),
                            cluster_key=str(made.key), cluster_server_name="tandem-cluster")
    tls = ClusterTls.from_args(ns)
    assert tls.server_name == "tandem-cluster"
    assert tls.argv()[-2:] == ["--cluster-server-name", "tandem-cluster"]
    wrong = ClusterTls(tls.ca, tls.cert, tls.key, "tandem-elsewhere")

    async def main():
        async with health_server(tls) as (address, _):
            codes = []
            for t in (tls, wrong):
                async with internal_channel(address, t, ()) as ch:
                    try:
                        await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(), timeout=5)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as e:
                        codes.append(e.code())
            probes = []
            for name in ("tandem-cluster", "tandem-elsewhere"):
                argv = ["--address", address, "--timeout", "5", *tls.argv()[:6],
                        "--cluster-server-name", name]
                probes.append(await asyncio.to_thread(healthcheck.main, argv))
            return codes, probes

    codes, probes = asyncio.run(main())
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE]
    assert probes == [0, 1]
    ns = argparse.Namespace(cluster_server_name="tandem-cluster")
    with pytest.raises(InvalidArgument) as e:
        ClusterTls.from_args(ns)  # a name without the certificates is a mistake, not a no-op
    assert e.value.field == "--cluster-server-name"

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
