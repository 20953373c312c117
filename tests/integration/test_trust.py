"""Trust boundaries of a whole stack, as an outside caller meets them: mutual TLS between router
and workers (a throwaway cluster CA, as `tandem up` makes), TLS and API keys on both public ports,
hostile input refused cheaply in OpenAI's error shape, and prefix-cache namespaces per key and
per cache_salt. Router, prefill and decode as processes on 127.0.0.1 (shm transport)."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

import tandem.client as tc
from cluster import Cluster
from tandem.cli.certs import make_cluster_ca
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.runtime.security import internal_channel
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

KEYS = ("key-of-tenant-a", "key-of-tenant-b")
WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64"]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust")
    keys = tmp / "api-keys"
    keys.write_text("# one tenant per line\n" + "\n".join(KEYS) + "\n")
    public = make_cluster_ca(tmp / "public").tls("router")  # any CA: a certificate for 127.0.0.1
    c = Cluster(tmp, str(tiny_models["llama"]), worker_args=WORKER_ARGS, cluster_ca=True,
                router_args=["--tls-cert", str(public.cert), "--tls-key", str(public.key)],
                env={"TANDEM_API_KEY_FILE": str(keys)}).start()
    c.public_ca = public.ca
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle(timeout=20))


def auth(key: str = KEYS[0]) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def url(cluster: Cluster, path: str) -> str:
    return f"https://127.0.0.1:{cluster.router.http_port}{path}"


def https(cluster: Cluster) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(cluster.public_ca)),
                        timeout=60)


def router_channel(cluster: Cluster) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(cluster.public_ca.read_bytes())
    return grpc.aio.secure_channel(cluster.router.address, creds)


def post(cluster: Cluster, path: str, body: dict | bytes, key: str = KEYS[0],
         **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with https(cluster) as client:
        return client.post(url(cluster, path), content=content,
                           headers={"authorization": f"Bearer {key}",
                                    "content-type": "application/json", **headers})


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


async def generate(cluster: Cluster, req: api_pb2.GenerateRequest, metadata=auth()):
    async with router_channel(cluster) as ch:
        chunks = [c async for c in api_pb2_grpc.TandemStub(ch).Generate(
            req, metadata=metadata, timeout=60)]
    return chunks


def request(prompt: list[int], params: SamplingParams = GREEDY) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                   params=params_to_proto(params))


# -- API keys on gRPC as on HTTP -----------------------------------------------------------------
def test_grpc_without_the_key_is_unauthenticated(cluster):
    async def main():
        for metadata in ((), auth("not-a-key"), (("authorization", KEYS[0]),)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(cluster, request([5, 6, 7]), metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert tc.error_from_rpc(e.value).reason == "INVALID_API_KEY"  # ErrorInfo
        async with router_channel(cluster) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api_pb2_grpc.TandemStub(ch).ListModels(api_pb2.ListModelsRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for key in KEYS:  # every key in the file is accepted
            chunks = await generate(cluster, request([5, 6, 7]), auth(key))
            assert sum(len(c.token_ids) for c in chunks) == 4
        chunks = await generate(cluster, request([5, 6, 7]),
                                (("authorization", f"bearer {KEYS[0]}"),))
        assert sum(len(c.token_ids) for c in chunks) == 4
    asyncio.run(main())
    with https(cluster) as client:
        r = client.post(url(cluster, "/v1/completions"), json={"prompt": [5], "max_tokens": 1})
        assert_openai_error(r, 401)
        r = client.post(url(cluster, "/v1/completions"), json={"prompt": [5], "max_tokens": 1},
                        headers={"Authorization": f"bearer {KEYS[0]}"})
        assert r.status_code == 200, r.text


def test_both_public_ports_speak_tls_only(cluster):
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
        httpx.get(f"http://127.0.0.1:{cluster.router.http_port}/health", timeout=10)
    with https(cluster) as client:
        assert client.get(url(cluster, "/health")).status_code == 200

    async def plaintext_grpc():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api_pb2_grpc.TandemStub(ch).ListModels(api_pb2.ListModelsRequest(),
                                                             metadata=auth(), timeout=5)
            return e.value.code()
    assert asyncio.run(plaintext_grpc()) == grpc.StatusCode.UNAVAILABLE


def test_the_key_is_on_no_command_line(cluster):
    for p in cluster.procs.values():
        cmdline = Path(f"/proc/{p.popen.pid}/cmdline").read_bytes()
        assert all(k.encode() not in cmdline for k in KEYS), p.name


def test_workers_are_not_handed_the_keys(cluster):
    """Workers never check an API key: their environment names no key and no key file (the
    router's does)."""
    def environ(p) -> set[bytes]:
        return {v.split(b"=", 1)[0] for v in
                Path(f"/proc/{p.popen.pid}/environ").read_bytes().split(b"\0")}
    assert b"TANDEM_API_KEY_FILE" in environ(cluster.router)
    for w in cluster.workers():
        assert not {b"TANDEM_API_KEY", b"TANDEM_API_KEY_FILE"} & environ(w), w.name


def test_generated_request_ids_are_random(cluster):
    chunks = asyncio.run(generate(cluster, request([5, 6, 7])))
    chunks += asyncio.run(generate(cluster, request([5, 6, 7])))
    ids = {c.request_id for c in chunks}
    assert len(ids) == 2
    for rid in ids:
        assert uuid.UUID(rid.removeprefix("req-")).version == 4


# -- mutual TLS on the internal hops -------------------------------------------------------------
def test_a_worker_refuses_callers_without_a_cluster_client_certificate(cluster, tmp_path):
    tls = cluster.cluster_tls
    other = make_cluster_ca(tmp_path / "other").tls("router")  # a CA the cluster never heard of

    async def get_load(address: str, creds: grpc.ChannelCredentials | None):
        ch = (grpc.aio.secure_channel(address, creds) if creds is not None
              else grpc.aio.insecure_channel(address))
        async with ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                                timeout=5)

    async def main():
        ca = tls.ca.read_bytes()
        for w in cluster.workers():
            for creds in (None,  # plaintext
                          grpc.ssl_channel_credentials(root_certificates=ca),  # no client cert
                          grpc.ssl_channel_credentials(  # a client cert of another CA
                              root_certificates=ca, private_key=other.key.read_bytes(),
                              certificate_chain=other.cert.read_bytes())):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await get_load(w.address, creds)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (w.name, e.value)
            load = await get_load(w.address, tls.channel_credentials())
            assert load.num_blocks == 256
    asyncio.run(main())


# Each worker RPC with a message that is harmless to send (refused, empty or unknown).
HARMLESS = {
    "Prefill": worker_pb2.PrefillRequest(),
    "Stream": worker_pb2.StreamRequest(cancel="nothing-running"),
    "Abort": worker_pb2.AbortRequest(request_id="nothing-running"),
    "GetLoad": worker_pb2.GetLoadRequest(),
    "WatchKV": worker_pb2.WatchKVRequest(),
    "Register": worker_pb2.RegisterRequest(),
    "ClaimLease": worker_pb2.ClaimLeaseRequest(lease_id="0" * 32),
    "RenewLeases": worker_pb2.RenewLeasesRequest(lease_ids=["0" * 32]),
    "Release": worker_pb2.ReleaseRequest(lease_id="0" * 32),
    "Move": worker_pb2.MoveRequest(request_id="nothing-running"),
    # A salt nobody cached under: nothing is lent (no lease left pinned).
    "LendPrefix": worker_pb2.LendPrefixRequest(prompt_token_ids=[7] * 40,
                                               cache_salt="nothing-cached"),
    # Not harmless where allowed (the worker drains and exits, or changes role): called only
    # where refused.
    "Drain": worker_pb2.DrainRequest(),
    "SwitchRole": worker_pb2.SwitchRoleRequest(role="decode"),
}


def test_each_role_calls_only_what_the_table_allows(cluster):
    """Every worker RPC called with each member's certificate (the router's, the prefill
    worker's, the decode worker's) on both workers: PERMISSION_DENIED, naming the caller,
    exactly where WORKER_CALLERS does not list the caller's role (or SELF, the worker's own),
    whatever the worker's role; anything else (an answer, or the servicer's own refusal) where
    it does. Drain and SwitchRole are called only where refused (elsewhere the worker would
    drain)."""
    from tandem.runtime.cluster_roles import WORKER_CALLERS, allowed

    assert set(HARMLESS) == set(WORKER_CALLERS)

    async def call(stub, method: str, may: bool):
        rpc = getattr(stub, method)
        try:
            if method == "Stream":
                # Where refused, the call ends at its start: a message written meanwhile fails
                # and gRPC's client reports INTERNAL for it instead of the worker's status
                # (grpc/grpc#36066). So nothing is sent before the call's end there.
                ended = asyncio.Event()

                async def nothing():
                    await ended.wait()
                    return
                    yield

                try:
                    async for _ in rpc(iter([HARMLESS[method]]) if may else nothing(),
                                       timeout=10):
                        pass
                finally:
                    ended.set()
            elif method == "WatchKV":
                watch = rpc(HARMLESS[method], timeout=10)
                await watch.read()  # the first message: the set of cached blocks
                watch.cancel()
            else:
                await rpc(HARMLESS[method], timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    async def main():
        wrong = []
        for caller in ("router", "prefill0", "decode0"):
            tls = cluster.cluster_certs.tls(caller)
            role = caller.rstrip("0")
            for w in cluster.workers():
                async with internal_channel(w.address, tls, (), w.name.rstrip("0")) as ch:
                    stub = worker_pb2_grpc.WorkerStub(ch)
                    for method in WORKER_CALLERS:
                        may = allowed(f"/tandem.v1.Worker/{method}", role, w.name.rstrip("0"))
                        if method in ("Drain", "SwitchRole") and may:
                            continue
                        code, details = await call(stub, method, may)
                        denied = code == grpc.StatusCode.PERMISSION_DENIED
                        if denied == may or \
                                (denied and f"spiffe://tandem/{role}/{caller}" not in details):
                            wrong.append((caller, w.name, method, code, details))
        assert not wrong, wrong

    asyncio.run(main())


def test_workers_listen_on_loopback_only(cluster):
    for w in cluster.workers():
        assert w.address.startswith("127.0.0.1:")
        assert "--host" not in w.argv or w.argv[w.argv.index("--host") + 1] == "127.0.0.1"
    listening = Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()
    for w in cluster.workers():
        port = f":{int(w.address.rsplit(':', 1)[1]):04X} "
        local = [ln.split()[1] for ln in listening.splitlines()[1:]
                 if ln.split()[1].endswith(port.strip()) and ln.split()[3] == "0A"]
        # 127.0.0.1, also as IPv4-mapped IPv6 (::ffff:127.0.0.1), or ::1; never a wildcard.
        assert local and all(a.split(":")[0].endswith("0100007F") or
                             a.split(":")[0] == "00000000000000000000000001000000"
                             for a in local), local


# -- hostile input: refused cheaply, in OpenAI's shape, naming the field --------------------------
HOSTILE = [
    # (body, status, param)
    (b'{"prompt": [5], "max_tokens": 4, "temperature": NaN}', 400, "temperature"),
    (b'{"prompt": [5], "max_tokens": 4, "repetition_penalty": Infinity}', 400,
     "repetition_penalty"),
    (b'{"prompt": [5], "max_tokens": 4, "temperature": 1e999}', 400, "temperature"),
    (b'{"prompt": [5], "max_tokens": 4294967296}', 400, "max_tokens"),
    (b'{"prompt": [5], "max_tokens": 4, "top_k": 4294967296}', 400, "top_k"),
    (b'{"prompt": [5], "max_tokens": 4, "stop_token_ids": [4294967296]}', 400, "stop_token_ids"),
    (b'{"prompt": [5], "max_tokens": 4, "n": 18446744073709551616}', 400, "n"),
    (b'{"prompt": [5], "max_tokens": 4, "n": 10000000}', 400, "n"),
    (b'{"prompt": "\\ud800", "max_tokens": 4}', 400, "prompt"),
    (b'{"prompt": [5], "max_tokens": 4, "stream": "yes"}', 400, "stream"),
    (b'{"prompt": [5], "max_tokens": true}', 400, "max_tokens"),
    (b'{"prompt": [5], "max_tokens": 4, "temperature": "0.5"}', 400, "temperature"),
    (b'{"prompt": [5], "max_tokens": 4, "cache_salt": 7}', 400, "cache_salt"),
    (b'{"prompt": [5], "max_tokens": 4, "seed": 1e3}', 400, "seed"),
    (b'{"prompt": [5], "max_tokens": 4, "logit_bias": {"5": NaN}}', 400, "logit_bias"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 4}', 400, None),  # not UTF-8
    (b'[' * 100_000 + b']' * 100_000, 400, None),  # nested far too deep
    (b'{"prompt": [5], "max_tokens": 4', 400, None),  # not JSON
]
CHAT_HOSTILE = [
    ({"messages": [{"role": {"a": 1}, "content": "hi"}], "max_tokens": 4}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}], "max_tokens": 4}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 4}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**32}, 400,
     "max_completion_tokens"),
]


@pytest.mark.parametrize("body,status,param", HOSTILE,
                         ids=[f"h{i}" for i in range(len(HOSTILE))])
def test_hostile_completion_bodies_get_openai_errors(cluster, body, status, param):
    assert_openai_error(post(cluster, "/v1/completions", body), status, param)


@pytest.mark.parametrize("body,status,param", CHAT_HOSTILE,
                         ids=[f"c{i}" for i in range(len(CHAT_HOSTILE))])
def test_hostile_chat_bodies_get_openai_errors(cluster, body, status, param):
    # json.dumps writes a lone surrogate as the escape "\ud800": the server sees it as JSON does.
    assert_openai_error(post(cluster, "/v1/chat/completions", body), status, param)


def test_framework_errors_are_in_openai_shape(cluster):
    with https(cluster) as client:
        assert_openai_error(client.get(url(cluster, "/v1/nowhere"), headers=dict(auth())), 404)
        assert_openai_error(client.delete(url(cluster, "/v1/completions"),
                                          headers=dict(auth())), 405)


def test_grpc_hostile_values_are_invalid_argument(cluster):
    async def refused(req) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(cluster, req)
        return e.value

    async def main():
        nan = request([5, 6])
        nan.params.temperature = float("nan")
        inf = request([5, 6])
        inf.params.repetition_penalty = float("inf")
        big_n = request([5, 6])
        big_n.params.n = 2**32 - 1
        long_id = request([5, 6])
        long_id.request_id = "x" * 10_000
        for req, field in ((nan, "temperature"), (inf, "repetition_penalty"), (big_n, "n"),
                           (long_id, "request_id")):
            e = await refused(req)
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e)
            assert field in e.details()
    asyncio.run(main())


# -- a huge prompt is refused at once and holds up nobody ----------------------------------------
BIG = 20_000_000  # characters: the 20 MB prompt


def test_a_20_mb_prompt_is_refused_fast_while_others_are_served(cluster):
    """The huge prompt is answered in well under a second (a generous bound for a loaded
    two-core machine; the tokenizer took 24 s on it), and another client's request, started
    first and running meanwhile, is served to its end."""
    text = "a " * (BIG // 2)
    other_done = threading.Event()
    other_result: list = []

    def other_client():
        chunks = asyncio.run(generate(cluster, request([9, 8, 7, 6], SamplingParams(
            temperature=0, max_tokens=48, ignore_eos=True))))
        other_result.append(sum(len(c.token_ids) for c in chunks))
        other_done.set()

    big = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    # Under the body limit, still far too long for the model: refused by length, untokenized.
    under_limit = json.dumps({"prompt": text[:7_000_000], "max_tokens": 4}).encode()
    t = threading.Thread(target=other_client)
    t.start()
    timings = {}
    t0 = time.perf_counter()
    r = post(cluster, "/v1/completions", big)
    timings["http"] = time.perf_counter() - t0
    assert_openai_error(r, 413)
    t0 = time.perf_counter()
    r = post(cluster, "/v1/completions", under_limit)
    timings["http_7mb"] = time.perf_counter() - t0
    assert_openai_error(r, 400, "prompt")

    async def grpc_big():
        req = api_pb2.GenerateRequest(text=text, params=params_to_proto(GREEDY))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(cluster, req)
        return e.value
    t0 = time.perf_counter()
    e = asyncio.run(grpc_big())
    timings["grpc"] = time.perf_counter() - t0
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in e.details()
    assert other_done.wait(60)
    t.join()
    assert other_result == [48]
    print(f"20 MB prompt answered in: {timings}")
    assert all(s < 1.0 for s in timings.values()), timings


# -- prefix-cache namespaces ---------------------------------------------------------------------
SHARED = [(31 * j) % 250 + 2 for j in range(50)]  # 3 full blocks of 16


def cached(cluster: Cluster, key: str, salt: str | None = None) -> int:
    body = {"prompt": SHARED, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = post(cluster, "/v1/completions", body, key=key)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_reveal_nothing_across_keys_or_salts(cluster):
    cached(cluster, KEYS[0])  # tenant A's prompt is cached now
    assert cached(cluster, KEYS[0]) == 48  # A sees its own prefix
    assert cached(cluster, KEYS[1]) == 0  # B learns nothing of A's prompt
    assert cached(cluster, KEYS[0], salt="alice") == 0  # another namespace within A
    assert cached(cluster, KEYS[0], salt="alice") == 48
    assert cached(cluster, KEYS[1], salt="alice") == 0  # a salt does not cross keys

    async def over_grpc(key: str, salt: str) -> int:
        req = request(SHARED, SamplingParams(temperature=0, max_tokens=1))
        req.params.cache_salt = salt
        chunks = await generate(cluster, req, auth(key))
        return chunks[-1].usage.cached_prompt_tokens
    assert asyncio.run(over_grpc(KEYS[0], "alice")) == 48  # one namespace on both APIs
    assert asyncio.run(over_grpc(KEYS[1], "bob")) == 0
    # The Python client: TLS, the key and the salt as its README section says.
    with tc.Client(cluster.router.address, api_key=KEYS[1], root_certificates=cluster.public_ca,
                   timeout=60) as client:
        answer = client.generate(SHARED, tc.SamplingParams(max_tokens=1, temperature=0,
                                                           cache_salt="bob"))
    assert answer.usage.cached_prompt_tokens == 48
