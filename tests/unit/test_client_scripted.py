"""tandem.client against a scripted Tandem server in this process (127.0.0.1): gRPC's retry
does what the client promises (UNAVAILABLE before any chunk retried, after a chunk never),
closing a stream cancels the call, rich error details become typed exceptions, the API key
travels as bearer metadata, and TLS / mutual TLS connect with the PEMs given."""

from __future__ import annotations

import asyncio
import collections
import datetime
import ipaddress
import threading
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tandem import client as tc
from tandem.errors import InvalidArgument, Overloaded
from tandem.router_svc.api_errors import failure_of, grpc_field, grpc_status
from tandem.v1 import api_pb2, api_pb2_grpc

FAST_RETRY = tc.RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


def chunk(text: str, finish: str = "") -> api_pb2.GenerateResponse:
    return api_pb2.GenerateResponse(request_id="r", text=text, token_ids=[len(text)],
                                    finish_reason=finish, usage=api_pb2.Usage(prompt_tokens=1))


class Scripted(api_pb2_grpc.TandemServicer):
    """Generate behaves as its text prompt says; counts the attempts per prompt."""

    def __init__(self) -> None:
        self.attempts: collections.Counter[str] = collections.Counter()
        self.previous: list[str | None] = []  # grpc-previous-rpc-attempts of each attempt
        self.cancelled = threading.Event()
        self.lock = threading.Lock()

    def Generate(self, request, context):  # noqa: N802
        script = request.text
        md = dict(context.invocation_metadata())
        with self.lock:
            self.attempts[script] += 1
            attempt = self.attempts[script]
            self.previous.append(md.get("grpc-previous-rpc-attempts"))
        if (script == "unavailable once" and attempt == 1) or script == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        if script in ERRORS:
            context.abort_with_status(grpc_status(*ERRORS[script]))
        if script == "who am i":
            yield chunk(md.get("authorization", ""), "stop")
            return
        yield chunk("a")
        if script == "unavailable after a token":
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker gone")
        if script == "endless":
            context.add_callback(self.cancelled.set)
            while context.is_active():
                yield chunk("x")
                self.cancelled.wait(0.01)
            return
        yield chunk("b", "length")


ERRORS = {
    "bad temperature": (failure_of(InvalidArgument("temperature", "must be >= 0, got -1")),
                        grpc_field("temperature")),
    "overloaded": (failure_of(Overloaded("2 requests in flight (limit 2)")), None),
}


@pytest.fixture
def server():
    servicer = Scripted()
    srv = grpc.server(futures.ThreadPoolExecutor(8))
    api_pb2_grpc.add_TandemServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(None)


def test_unavailable_before_any_chunk_is_retried(server):
    servicer, target = server
    with tc.Client(target, retry=FAST_RETRY, timeout=10) as client:
        out = client.generate("unavailable once")
    assert out.text == "ab" and out.samples[0].finish_reason == "length"
    assert servicer.attempts["unavailable once"] == 2
    assert servicer.previous == [None, "1"]  # gRPC's own retry, not a second call


def test_unavailable_after_a_chunk_is_never_retried(server):
    servicer, target = server
    with tc.Client(target, retry=FAST_RETRY, timeout=10) as client:
        got = []
        with pytest.raises(tc.UnavailableError) as e:
            for c in client.stream("unavailable after a token"):
                got.append(c.text)
    assert got == ["a"]
    assert servicer.attempts["unavailable after a token"] == 1
    assert "decode worker gone" in e.value.message


def test_retries_stop_at_max_attempts_and_can_be_turned_off(server):
    servicer, target = server
    with tc.Client(target, retry=FAST_RETRY, timeout=10) as client, \
            pytest.raises(tc.UnavailableError):
        client.generate("unavailable")
    assert servicer.attempts["unavailable"] == FAST_RETRY.max_attempts
    with tc.Client(target, retry=None, timeout=10) as client, pytest.raises(tc.UnavailableError):
        client.generate("unavailable")
    assert servicer.attempts["unavailable"] == FAST_RETRY.max_attempts + 1


def test_async_client_retries_the_same_way(server):
    servicer, target = server

    async def main():
        async with tc.AsyncClient(target, retry=FAST_RETRY, timeout=10) as client:
            out = await client.generate("unavailable once")
            with pytest.raises(tc.UnavailableError):
                async for _ in client.stream("unavailable after a token"):
                    pass
            return out

    assert asyncio.run(main()).text == "ab"
    assert servicer.attempts == {"unavailable once": 2, "unavailable after a token": 1}


def test_closing_a_stream_cancels_the_call(server):
    servicer, target = server
    with tc.Client(target, timeout=30) as client:
        stream = client.stream("endless")
        assert [next(stream).text for _ in range(3)] == ["a", "x", "x"]
        stream.close()
        assert servicer.cancelled.wait(10), "the server never saw the cancel"


def test_rich_status_details_become_typed_errors(server):
    _, target = server
    with tc.Client(target, timeout=10) as client:
        with pytest.raises(tc.InvalidArgumentError) as bad:
            client.generate("bad temperature")
        with pytest.raises(tc.OverloadedError) as full:
            client.generate("overloaded")
    e = bad.value
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.reason == "INVALID_VALUE"
    assert e.field == "params.temperature"
    assert e.violations[0].description == "must be >= 0, got -1"
    assert full.value.retry_after == 1.0 and full.value.reason == "RATE_LIMIT_EXCEEDED"


def test_api_key_is_sent_as_bearer_metadata(server):
    _, target = server
    with tc.Client(target, api_key="s3cret", timeout=10) as client:
        assert client.generate("who am i").text == "Bearer s3cret"
    with tc.Client(target, timeout=10) as client:
        assert client.generate("who am i").text == ""


# -- TLS ---------------------------------------------------------------------------------------
def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_key, issuer: str | None = None, ca: bool = False):
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer or subject)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(hours=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    ca_key, srv_key, cli_key = _key(), _key(), _key()
    ca = _cert("test CA", ca_key, ca_key, ca=True)
    d = tmp_path_factory.mktemp("pki")
    files = {"ca.pem": _pem(ca), "server.pem": _pem(_cert("server", srv_key, ca_key, "test CA")),
             "server.key": _pem(srv_key), "client.pem": _pem(_cert("client", cli_key, ca_key,
                                                                   "test CA")),
             "client.key": _pem(cli_key)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


@pytest.fixture
def mtls_server(pki):
    servicer = Scripted()
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    api_pb2_grpc.add_TandemServicer_to_server(servicer, srv)
    creds = grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())],
        root_certificates=(pki / "ca.pem").read_bytes(), require_client_auth=True)
    port = srv.add_secure_port("127.0.0.1:0", creds)
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(None)


def test_mutual_tls_with_certificate_files(pki, mtls_server):
    with tc.Client(mtls_server, root_certificates=pki / "ca.pem",
                   client_certificate=str(pki / "client.pem"),
                   client_key=(pki / "client.key").read_bytes(), api_key="k",
                   timeout=10) as client:
        assert client.generate("who am i").text == "Bearer k"


def test_tls_without_the_client_certificate_is_refused(pki, mtls_server):
    with tc.Client(mtls_server, root_certificates=pki / "ca.pem", retry=None,
                   timeout=10) as client, pytest.raises(tc.UnavailableError):
        client.generate("who am i")
    with pytest.raises(ValueError, match="go together"):
        tc.Client(mtls_server, client_certificate=pki / "client.pem")


def test_router_reflection_is_on_unless_turned_off():
    import argparse

    from tandem.router_svc.server import add_router_args

    p = argparse.ArgumentParser()
    add_router_args(p)
    assert p.parse_args(["--model", "m"]).reflection is True
    assert p.parse_args(["--model", "m", "--no-reflection"]).reflection is False
    assert p.parse_args(["--model", "m", "--reflection"]).reflection is True
