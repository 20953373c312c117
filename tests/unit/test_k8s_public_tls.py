"""deploy/k8s, the router's public ports: TLS only, with the certificate of a Secret, to
callers with a key from another, which is on no command line. The router started with the
manifest's own flags (on loopback) shows that this holds on the wire."""

from __future__ import annotations

import asyncio
import copy
import re
from pathlib import PurePosixPath

import pytest
import yaml
from k8s_manifests import (
    DOCS,
    K8S,
    KEY_FILE,
    KEY_SECRET,
    PROBES,
    PUBLIC_FILES,
    PUBLIC_SECRET,
    ROLE,
    SECRETS,
    SERVICES,
    _certs_dir,
    _container,
    _container_port,
    _documented,
    _flag,
    _get,
    _k8s_readme,
    _probe_argv,
    _secret_file_problem,
    _secret_mounts,
    _without_flag,
)


def _public_problems(deployment: dict) -> list[str]:
    """What keeps the router's public ports from being TLS only, to callers with a key: the
    TLS flags (both ports) and --api-key-file, each on a file of its Secret under a read-only
    mount; probes the kubelet can make to a TLS port (its gRPC probe speaks plaintext; an
    httpGet must say HTTPS; `tandem health` needs --tls-ca), scraping over https."""
    d = copy.deepcopy(deployment)
    pod = d["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    problems = []
    for secret, files in ((PUBLIC_SECRET, PUBLIC_FILES), (KEY_SECRET, {"--api-key-file": KEY_FILE})):
        mounts, found = _secret_mounts(pod, c, secret)
        problems += found
        for flag, file in files.items():
            problem = _secret_file_problem(c["args"], flag, file, secret, mounts, c["name"])
            if problem:
                problems.append(problem)
    for kind in PROBES:
        probe = c[kind]
        if "grpc" in probe:
            problems.append(f"{kind}: the kubelet's gRPC probe speaks plaintext to a TLS port")
        if "httpGet" in probe and probe["httpGet"].get("scheme", "HTTP") != "HTTPS":
            problems.append(f"{kind}: plain HTTP to a TLS port")
        argv = _probe_argv(probe)
        if argv is not None and "--tls-ca" not in argv:
            problems.append(f"{kind}: `tandem health` without --tls-ca to a TLS port")
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    if annotations.get("prometheus.io/scheme") != "https":
        problems.append("/metrics is scraped in plaintext from a TLS port")
    return problems


def _key_exposures(deployment: dict) -> list[str]:
    """Where a pod would show an API key: a key flag or a variable holding one on a command
    line (its own or a probe's), or a key written into the manifest as an env value."""
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    problems = []
    lines = {"args": c["args"], **{kind: c[kind]["exec"]["command"]
                                   for kind in PROBES if "exec" in c.get(kind, {})}}
    for where, argv in lines.items():
        for a in argv:
            if re.search(r"--api-key(?!-file)|TANDEM_API_KEY(?!_FILE)|authorization|bearer",
                         a, re.IGNORECASE):
                problems.append(f"{where}: {a!r}")
    for e in c.get("env", []):
        if "KEY" in e["name"].upper() and "value" in e:
            problems.append(f"env {e['name']} is written into the manifest")
    return problems


def test_the_router_serves_tls_only_with_its_secret_and_asks_a_key_from_another() -> None:
    assert _public_problems(_get("Deployment", "tandem-router")) == []


@pytest.mark.parametrize("deployment", SERVICES)
def test_no_api_key_is_on_any_command_line(deployment) -> None:
    assert _key_exposures(_get("Deployment", deployment)) == []


def _public_mutations():
    """(what, change to the router's container, pod spec, pod metadata) that must each break
    its public TLS or keys."""
    for flag in (*PUBLIC_FILES, "--api-key-file"):
        yield f"args without {flag}", lambda c, p, m, f=flag: _without_flag(c["args"], f)
    for volume in ("public-tls", "api-keys"):
        yield f"no {volume} mount", lambda c, p, m, v=volume: c.__setitem__(
            "volumeMounts", [x for x in c["volumeMounts"] if x["name"] != v])
        yield f"{volume} writable", lambda c, p, m, v=volume: [
            x.__setitem__("readOnly", False) for x in c["volumeMounts"] if x["name"] == v]
        yield f"{volume} optional", lambda c, p, m, v=volume: [
            x["secret"].__setitem__("optional", True) for x in p["volumes"] if x["name"] == v]
        yield f"{volume} world-readable", lambda c, p, m, v=volume: [
            x["secret"].__setitem__("defaultMode", 0o444) for x in p["volumes"] if x["name"] == v]
        yield f"{volume} of another Secret", lambda c, p, m, v=volume: [
            x["secret"].__setitem__("secretName", "x") for x in p["volumes"] if x["name"] == v]
    yield "key outside the mount", lambda c, p, m: c["args"].__setitem__(
        c["args"].index("--tls-key") + 1, "/etc/tls.key")
    yield "the cluster's key", lambda c, p, m: c["args"].__setitem__(
        c["args"].index("--tls-key") + 1, "/certs/router.key")
    yield "key file not the Secret's", lambda c, p, m: c["args"].__setitem__(
        c["args"].index("--tls-key") + 1, "/tls/router.key")
    yield "the kubelet's gRPC probe", lambda c, p, m: c.__setitem__(
        "readinessProbe", {"grpc": {"port": 50051}})
    yield "an HTTP probe", lambda c, p, m: c["startupProbe"]["httpGet"].pop("scheme")
    yield "tandem health without --tls-ca", lambda c, p, m: c.__setitem__(
        "livenessProbe", {"exec": {"command": [
            "sh", "-c", 'exec tandem health --address "$POD_IP:50051" --timeout 5']}})
    yield "plaintext scrape", lambda c, p, m: m["annotations"].pop("prometheus.io/scheme")


@pytest.mark.parametrize("what,mutate", list(_public_mutations()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_public_tls_check_catches_each_missing_piece(what, mutate) -> None:
    d = copy.deepcopy(_get("Deployment", "tandem-router"))
    pod = d["spec"]["template"]["spec"]
    mutate(pod["containers"][0], pod, d["spec"]["template"]["metadata"])
    assert _public_problems(d), what


@pytest.mark.parametrize("what,mutate", [
    ("--api-key", lambda c: c["args"].extend(["--api-key", "sk-123"])),
    ("--api-key=", lambda c: c["args"].append("--api-key=sk-123")),
    ("$(TANDEM_API_KEY)", lambda c: c["args"].extend(["--api-key-file", "$(TANDEM_API_KEY)"])),
    ("a key as an env value", lambda c: c["env"].append({"name": "TANDEM_API_KEY",
                                                          "value": "sk-123"})),
    ("a probe with the key", lambda c: c.__setitem__("livenessProbe", {"exec": {"command": [
        "sh", "-c", 'curl -H "Authorization: Bearer $TANDEM_API_KEY" https://127.0.0.1:8000']}})),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_key_check_catches_a_key_where_ps_shows_it(what, mutate) -> None:
    d = copy.deepcopy(_get("Deployment", "tandem-router"))
    mutate(d["spec"]["template"]["spec"]["containers"][0])
    assert _key_exposures(d), what


def test_no_key_material_is_committed() -> None:
    assert not [d for d in DOCS if d["kind"] == "Secret"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "secretGenerator" not in kustomization  # it would need files CI does not have
    for f in K8S.rglob("*"):
        if f.is_file():
            assert "PRIVATE KEY" not in f.read_text(), f


def test_the_documented_certificate_passes_every_probe_and_the_routers_calls(tmp_path) -> None:
    """With a certificate made as the README says, on loopback: each worker's probe command
    (certificate paths under tmp_path, $POD_IP 127.0.0.1) gets SERVING from a server that asks
    for client certificates, as a worker does; the router's TLS flags reach it too; a caller
    without a certificate does not."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from health_server import health_server

    from tandem.cli import health as healthcheck
    from tandem.cli.certs import make_cluster_ca
    from tandem.cli.main import build_parser
    from tandem.runtime.security import ClusterTls, internal_channel

    doc = _documented(_k8s_readme())
    made = make_cluster_ca(tmp_path, doc.certs[_certs_dir(doc, doc.generic[SECRETS[
        "tandem-router"]])])

    def local(argv: list[str], address: str) -> list[str]:
        argv = [a.replace("/certs/", f"{tmp_path}/") for a in argv]
        argv[argv.index("--address") + 1] = address
        return argv

    async def main():
        codes, statuses = [], []
        for d in ("tandem-prefill", "tandem-decode"):
            role = ROLE[d]
            async with health_server(made.tls(role)) as (address, _):  # a worker of that role
                c = _container(d)
                for kind in PROBES:
                    argv = _probe_argv(c[kind])
                    assert argv[argv.index("--address") + 1].startswith("$POD_IP:")
                    codes.append(await asyncio.to_thread(
                        healthcheck.main, local(argv[1:], address)))
                # TLS trusting the CA, but no client certificate: refused in the handshake.
                bare = ["--address", address, "--tls-ca", str(made.ca),
                        "--cluster-server-name", f"{role}.tandem.internal"]
                codes.append(await asyncio.to_thread(healthcheck.main, bare))
                router = build_parser("router").parse_args(
                    [a.replace("/certs/", f"{tmp_path}/")
                     for a in _container("tandem-router")["args"]])
                async with internal_channel(address, ClusterTls.from_args(router), (),
                                            role) as ch:
                    reply = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=5)
                statuses.append(reply.status)
        return codes, statuses

    codes, statuses = asyncio.run(main())
    assert codes == [0, 0, 0, 1] * 2
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2


def test_the_router_started_with_the_manifests_flags_serves_tls_only(tmp_path) -> None:
    """The router's command line from the manifest, run: its Secrets' files under tmp_path,
    made as the README says; on loopback (127.0.0.1) with free ports; the workers' Services
    resolving to one fake worker that answers polls over the cluster's mutual TLS. A client
    trusting the public CA gets through on both ports, and a key is asked of it; the kubelet's
    readiness probe (HTTPS, certificate unchecked) gets 200; a plaintext client gets nothing on
    either port, nor one that trusts only the cluster CA."""
    import shutil
    import ssl

    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.cli.certs import make_cluster_ca
    from tandem.cli.main import build_parser
    from tandem.engine.demo import build_demo_checkpoint
    from tandem.router_svc.server import serve
    from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

    doc = _documented(_k8s_readme())
    cluster_dir = _certs_dir(doc, doc.generic[SECRETS["tandem-router"]])
    cluster = make_cluster_ca(tmp_path / "certs", doc.certs[cluster_dir])
    cert, key = doc.tls[PUBLIC_SECRET]
    public = make_cluster_ca(tmp_path / "public", doc.certs[_certs_dir(doc, [cert, key])])
    (tmp_path / "tls").mkdir()  # what `kubectl create secret tls` mounts
    shutil.copy(public.dir / PurePosixPath(cert).name, tmp_path / "tls" / PUBLIC_FILES["--tls-cert"])
    shutil.copy(public.dir / PurePosixPath(key).name, tmp_path / "tls" / PUBLIC_FILES["--tls-key"])
    (tmp_path / "api-keys").mkdir()
    (tmp_path / "api-keys" / KEY_FILE).write_text("# tenants\nk-one\nk-two\n")
    (tmp_path / "models" / "demo").mkdir(parents=True)
    build_demo_checkpoint(tmp_path / "models" / "demo")

    c = _container("tandem-router")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    local = {"/certs": tmp_path / "certs", "/tls": tmp_path / "tls",
             "/api-keys": tmp_path / "api-keys", "/models": tmp_path / "models"}
    assert set(local) <= set(mounts)

    def here(a: str) -> str:
        a = a.replace("$(TANDEM_MODEL_DIR)", "demo")
        head, _, rest = a.partition("/")[2].partition("/")
        return str(local[f"/{head}"] / rest) if a.startswith("/") and f"/{head}" in local else a

    class FakeWorker(worker_pb2_grpc.WorkerServicer):
        async def GetLoad(self, request, context):  # noqa: N802
            return worker_pb2.Load(worker_id="fake", block_size=16)

    async def main():
        worker = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(FakeWorker(), worker)
        # The two Services' fake worker, with each role's certificate on the port of its role.
        ports = [worker.add_secure_port("127.0.0.1:0", cluster.tls(role).server_credentials())
                 for role in ("prefill", "decode")]
        await worker.start()
        args = [here(a) for a in c["args"]]
        for flag, value in (("--host", "127.0.0.1"), ("--grpc-port", "0"), ("--http-port", "0"),
                            ("--prefill-dns", f"127.0.0.1:{ports[0]}"),
                            ("--decode-dns", f"127.0.0.1:{ports[1]}"),
                            ("--membership-interval", "0.2"), ("--grace", "1")):
            args[args.index(flag) + 1] = value
        ready = tmp_path / "ready"
        ns = build_parser().parse_args([*args, "--poll-interval", "0.1",
                                        "--ready-file", str(ready)])
        stop = asyncio.Event()
        router = asyncio.create_task(serve(ns, stop))
        try:
            while not ready.exists():
                if router.done():
                    router.result()
                await asyncio.sleep(0.05)
            grpc_port, http_port = (int(p) for p in ready.read_text().split())
            return await calls(grpc_port, http_port)
        finally:
            stop.set()
            await router
            await worker.stop(None)

    async def calls(grpc_port: int, http_port: int) -> dict:
        seen: dict = {}
        grpc_address = f"127.0.0.1:{grpc_port}"
        trusted = grpc.ssl_channel_credentials(public.ca.read_bytes())
        async with grpc.aio.secure_channel(grpc_address, trusted) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for _ in range(100):  # until the router has polled the worker
                seen["grpc health"] = (await health.Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)).status
                if seen["grpc health"] == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.05)
            api = api_pb2_grpc.TandemStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.ListModels(api_pb2.ListModelsRequest(), timeout=5)
            seen["grpc without key"] = e.value.code()
            reply = await api.ListModels(api_pb2.ListModelsRequest(), timeout=5,
                                         metadata=(("authorization", "Bearer k-two"),))
            seen["grpc models"] = [m.id for m in reply.models]
        for name, channel in (
                ("grpc plaintext", grpc.aio.insecure_channel(grpc_address)),
                ("grpc cluster CA", grpc.aio.secure_channel(grpc_address, grpc.ssl_channel_credentials(
                    cluster.ca.read_bytes())))):
            async with channel as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5)
                seen[name] = e.value.code()

        https = f"https://127.0.0.1:{http_port}"
        verify = ssl.create_default_context(cafile=str(public.ca))
        async with httpx.AsyncClient(verify=verify, timeout=10) as client:
            seen["http without key"] = (await client.get(f"{https}/v1/models")).status_code
            r = await client.get(f"{https}/v1/models", headers={"Authorization": "Bearer k-one"})
            seen["http models"] = [m["id"] for m in r.json()["data"]]
        probe = c["readinessProbe"]["httpGet"]  # the kubelet checks no certificate
        assert _container_port(c, probe["port"]) == int(_flag(c["args"], "--http-port"))
        scheme = probe["scheme"].lower()
        async with httpx.AsyncClient(verify=False, timeout=10) as kubelet:
            seen["probe"] = (await kubelet.get(f"{scheme}://127.0.0.1:{http_port}{probe['path']}")
                             ).status_code
        for name, client in (
                ("http plaintext", httpx.AsyncClient(timeout=10)),
                ("http cluster CA", httpx.AsyncClient(
                    timeout=10, verify=ssl.create_default_context(cafile=str(cluster.ca))))):
            url = f"{'http' if 'plaintext' in name else 'https'}://127.0.0.1:{http_port}/health"
            async with client:
                try:
                    seen[name] = (await client.get(url)).status_code
                except httpx.HTTPError as e:
                    seen[name] = type(e).__name__
        return seen

    seen = asyncio.run(main())
    refused = {k: v for k, v in seen.items() if "plaintext" in k or "cluster CA" in k}
    assert seen == {
        "grpc health": health_pb2.HealthCheckResponse.SERVING,
        "grpc without key": grpc.StatusCode.UNAUTHENTICATED,
        "grpc models": ["demo"],
        "http without key": 401,
        "http models": ["demo"],
        "probe": 200,
        **refused,
    }
    assert refused["grpc plaintext"] == refused["grpc cluster CA"] == grpc.StatusCode.UNAVAILABLE
    assert all(isinstance(refused[k], str) for k in ("http plaintext", "http cluster CA")), refused
