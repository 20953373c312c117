"""deploy/k8s: every manifest is valid against the Kubernetes API's JSON schemas (offline,
kubernetes-validate, strict: unknown fields are errors), and the pieces are wired together:
the router's worker addresses name Services whose ports lead to the workers' gRPC ports,
probes and scrape annotations name ports the containers serve, workers get a GPU each, and
prefill serves its pool over NIXL, and every hop between router and workers is mutual TLS with
the certificates of one Secret, which the workers' probes present too."""

from __future__ import annotations

import asyncio
import copy
import re
import shlex
from pathlib import Path, PurePosixPath

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"


def _docs() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


DOCS = _docs()


def _get(kind: str, name: str) -> dict:
    (doc,) = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _container(deployment: str) -> dict:
    (c,) = _get("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return c


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _container_port(c: dict, port: int | str) -> int:
    """A probe's or Service's port (number or name) resolved against the container's ports;
    fails when the container does not declare it."""
    for p in c["ports"]:
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    raise AssertionError(f"{c['name']} declares no port {port!r}")


def _probe_argv(probe: dict) -> list[str] | None:
    """An exec probe's `tandem health` arguments (after `tandem`; $POD_IP left as written), or
    None for a probe the kubelet makes itself."""
    if "exec" not in probe:
        return None
    command = probe["exec"]["command"]
    assert command[:2] == ["sh", "-c"] and len(command) == 3, command
    words = shlex.split(command[2])
    assert words[:3] == ["exec", "tandem", "health"], words
    return words[2:]


def _probe_port(c: dict, probe: dict) -> int:
    argv = _probe_argv(probe)
    if argv is not None:
        from cli.main import build_parser

        return int(build_parser("health").parse_args(argv).address.rsplit(":", 1)[1])
    (how,) = {"grpc", "tcpSocket", "httpGet"} & probe.keys()
    return _container_port(c, probe[how]["port"])


def test_the_kustomization_lists_every_manifest_in_the_folder() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_against_the_kubernetes_schemas(doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validation_catches_a_misspelt_field() -> None:
    bad = copy.deepcopy(_get("Deployment", "tandem-prefill"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_router_addresses_lead_through_services_to_the_workers_grpc_ports() -> None:
    """--prefill-dns/--decode-dns: the router routes to every pod a headless Service lists."""
    args = _container("tandem-router")["args"]
    for flag, deployment in (("--prefill-dns", "tandem-prefill"),
                             ("--decode-dns", "tandem-decode")):
        host, port = _flag(args, flag).rsplit(":", 1)
        service = _get("Service", host)
        assert service["spec"]["clusterIP"] == "None"  # DNS lists the pods, not a virtual IP
        (sp,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        worker = _container(deployment)
        pod_labels = _get("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert _container_port(worker, sp["targetPort"]) == int(_flag(worker["args"], "--port"))


def test_each_deployment_selects_its_own_pods_and_only_them() -> None:
    deployments = [d for d in DOCS if d["kind"] == "Deployment"]
    for d in deployments:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        others = [o for o in deployments if o is not d]
        for o in others:
            assert not (d["spec"]["selector"]["matchLabels"].items()
                        <= o["spec"]["template"]["metadata"]["labels"].items())


@pytest.mark.parametrize("deployment", ["tandem-prefill", "tandem-decode", "tandem-router"])
def test_probes_and_scrape_annotations_name_ports_the_container_serves(deployment) -> None:
    d = _get("Deployment", deployment)
    c = _container(deployment)
    args = c["args"]
    grpc_port = int(_flag(args, "--port" if "--port" in args else "--grpc-port"))
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert _probe_port(c, probe) == grpc_port, (kind, probe)
        argv = _probe_argv(probe)
        if argv is not None:
            # `tandem health` answers within the kubelet's limit, so its exit code is what counts.
            timeout = float(argv[argv.index("--timeout") + 1])
            assert timeout < probe["timeoutSeconds"], (kind, probe)
            # The kubelet runs it without $(VAR) expansion of env from fields: sh expands it.
            assert f'"$POD_IP:{grpc_port}"' in probe["exec"]["command"][2]
    # grpc.health.v1, not just an open port
    assert "grpc" in c["readinessProbe"] or _probe_argv(c["readinessProbe"]) is not None
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    metrics = int(annotations["prometheus.io/port"])
    served = int(_flag(args, "--metrics-port" if "--metrics-port" in args else "--http-port"))
    assert metrics == served == _container_port(c, metrics)
    # Drains within the grace the worker is given, before the kubelet's SIGKILL.
    grace = float(_flag(args, "--grace"))
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


def test_workers_get_a_gpu_each_and_prefill_serves_its_pool_over_nixl() -> None:
    for deployment in ("tandem-prefill", "tandem-decode"):
        c = _container(deployment)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        # Listening on the pod IP is what the worker hands peers as its address.
        assert _flag(c["args"], "--host") == "$(POD_IP)"
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
            in c["env"]
    assert _flag(_container("tandem-prefill")["args"], "--transport") == "nixl"
    assert "nvidia.com/gpu" not in str(_container("tandem-router").get("resources"))


def test_the_worker_and_router_flags_parse_with_the_cli() -> None:
    """Each container's args are a command line the `tandem` CLI accepts."""
    from cli.main import build_parser

    parser = build_parser()
    for deployment in ("tandem-prefill", "tandem-decode", "tandem-router"):
        args = [re.sub(r"\$\((\w+)\)", "x", a) for a in _container(deployment)["args"]]
        ns = parser.parse_args(args)
        assert ns.func is not None


def test_every_variable_a_command_line_uses_is_defined_in_the_container() -> None:
    for deployment in ("tandem-prefill", "tandem-decode", "tandem-router"):
        c = _container(deployment)
        defined = {e["name"] for e in c["env"]}
        used = {v for a in c["args"] for v in re.findall(r"\$\((\w+)\)", a)}
        assert used <= defined, (deployment, used - defined)
        config = _get("ConfigMap", "tandem-config")["data"]
        for e in c["env"]:
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["key"] in config


def test_the_cli_check_would_catch_a_flag_the_cli_does_not_know() -> None:
    from cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--model", "m", "--transport", "carrier-pigeon"])


# -- mutual TLS between router and workers -------------------------------------------------------
SECRET = "tandem-cluster-tls"
SERVER_NAME = "tandem-cluster"
# Each flag and the file (a key of the Secret) it names.
CLUSTER_FILES = {"--cluster-ca": "ca.pem", "--cluster-cert": "node.pem", "--cluster-key": "node.key"}
SERVICES = ("tandem-prefill", "tandem-decode", "tandem-router")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def _mtls_problems(deployment: dict) -> list[str]:
    """What is missing for the pod to speak mutual TLS with the cluster Secret: the three
    certificate flags on its command line, each naming a file the Secret provides under a
    read-only mount of it, the agreed server name, and (workers, whose gRPC port asks callers
    for a certificate) the same on every probe. Empty when all is there."""
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    problems = []
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", [])
               if v.get("secret", {}).get("secretName") == SECRET}
    mounts = {m["mountPath"].rstrip("/"): m for m in c.get("volumeMounts", [])
              if m["name"] in volumes}
    if not mounts:
        problems.append(f"no volume of Secret {SECRET} is mounted")
    for path, m in mounts.items():
        if not m.get("readOnly"):
            problems.append(f"{path} is not mounted read-only")
        secret = volumes[m["name"]]
        if secret.get("optional"):
            problems.append(f"{SECRET} is optional: a pod would start without its certificates")
        if secret.get("defaultMode", 0o644) & 0o007:
            problems.append(f"{SECRET}'s files are readable by every user of the container")

    def check(argv: list[str], where: str) -> None:
        for flag, file in CLUSTER_FILES.items():
            if flag not in argv:
                problems.append(f"{where}: no {flag}")
                continue
            path = PurePosixPath(argv[argv.index(flag) + 1])
            mount = mounts.get(str(path.parent))
            if mount is None:
                problems.append(f"{where}: {flag} {path} is not under a mount of {SECRET}")
                continue
            items = volumes[mount["name"]].get("items")
            provided = {i["path"] for i in items} if items else set(CLUSTER_FILES.values())
            if path.name != file or path.name not in provided:
                problems.append(f"{where}: {flag} {path} is not the Secret's {file}")
        name = argv[argv.index("--cluster-server-name") + 1] \
            if "--cluster-server-name" in argv else None
        if name != SERVER_NAME:
            problems.append(f"{where}: --cluster-server-name is {name!r}, not {SERVER_NAME!r}")

    check(c["args"], c["name"])
    if c["args"][0] in ("prefill", "decode", "worker"):
        for kind in PROBES:
            argv = _probe_argv(c[kind])
            if argv is None:
                problems.append(f"{kind} presents no client certificate")
            else:
                check(argv, kind)
    return problems


@pytest.mark.parametrize("deployment", SERVICES)
def test_every_router_and_worker_speaks_mutual_tls_with_the_secret(deployment) -> None:
    assert _mtls_problems(_get("Deployment", deployment)) == []


def _without_flag(argv: list[str], flag: str) -> None:
    i = argv.index(flag)
    del argv[i:i + 2]


def _probe_without(flag: str):
    def mutate(c: dict) -> None:
        words = shlex.split(c["readinessProbe"]["exec"]["command"][2])
        _without_flag(words, flag)
        c["readinessProbe"]["exec"]["command"][2] = shlex.join(words)
    return mutate


def _mutations():
    """(deployment, what, change to its container, pod spec) that must each break mTLS."""
    for d in SERVICES:
        for flag in (*CLUSTER_FILES, "--cluster-server-name"):
            yield d, f"args without {flag}", lambda c, p, f=flag: _without_flag(c["args"], f)
        yield d, "no mount", lambda c, p: c.__setitem__(
            "volumeMounts", [m for m in c["volumeMounts"] if m["name"] != "cluster-tls"])
        yield d, "writable mount", lambda c, p: [m.__setitem__("readOnly", False)
                                                 for m in c["volumeMounts"]]
        yield d, "another Secret", lambda c, p: [v["secret"].__setitem__("secretName", "x")
                                                 for v in p["volumes"] if "secret" in v]
        yield d, "optional Secret", lambda c, p: [v["secret"].__setitem__("optional", True)
                                                  for v in p["volumes"] if "secret" in v]
        yield d, "world-readable key", lambda c, p: [
            v["secret"].__setitem__("defaultMode", 0o444) for v in p["volumes"] if "secret" in v]
        yield d, "key outside the mount", lambda c, p: c["args"].__setitem__(
            c["args"].index("--cluster-key") + 1, "/etc/node.key")
        yield d, "key file not the Secret's", lambda c, p: c["args"].__setitem__(
            c["args"].index("--cluster-key") + 1, "/certs/tls.key")
    for d in ("tandem-prefill", "tandem-decode"):
        for flag in (*CLUSTER_FILES, "--cluster-server-name"):
            yield d, f"probe without {flag}", lambda c, p, f=flag: _probe_without(f)(c)
        yield d, "kubelet's gRPC probe", lambda c, p: c.__setitem__(
            "livenessProbe", {"grpc": {"port": c["ports"][0]["containerPort"]}})


@pytest.mark.parametrize("deployment,what,mutate", list(_mutations()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_mtls_check_catches_each_missing_piece(deployment, what, mutate) -> None:
    d = copy.deepcopy(_get("Deployment", deployment))
    pod = d["spec"]["template"]["spec"]
    mutate(pod["containers"][0], pod)
    assert _mtls_problems(d), what


def _documented(text: str) -> tuple[str, str, list[str]]:
    """The `tandem certs` hosts, the Secret's name and its --from-file names a text documents."""
    text = text.replace("\n#", "\n").replace("\\\n", " ")  # comments, continued lines
    hosts = re.search(r"tandem certs --out (\S+) --hosts (\S+)", text)
    secret = re.search(r"create secret generic (\S+)((?: +--from-file=\S+)+)", text)
    assert hosts and secret, "no `tandem certs` and `kubectl create secret` commands"
    files = [PurePosixPath(f).name for f in re.findall(r"--from-file=(\S+)", secret.group(2))]
    return hosts.group(2), secret.group(1), files


def _k8s_readme() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Deploying on Kubernetes", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("where", ["kustomization.yaml", "README.md"])
def test_the_documented_secret_is_the_one_the_pods_mount(where) -> None:
    text = (K8S / where).read_text() if where != "README.md" else _k8s_readme()
    hosts, secret, files = _documented(text)
    assert secret == SECRET
    assert sorted(files) == sorted(CLUSTER_FILES.values())
    assert SERVER_NAME in hosts.split(",")
    for d in SERVICES:
        pod = _get("Deployment", d)["spec"]["template"]["spec"]
        assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {SECRET}


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

    from cli import health as healthcheck
    from cli.certs import make_cluster_ca
    from cli.main import build_parser
    from runtime.security import ClusterTls, internal_channel

    hosts, _, _ = _documented(_k8s_readme())
    made = make_cluster_ca(tmp_path, hosts.split(","))

    def local(argv: list[str], address: str) -> list[str]:
        argv = [a.replace("/certs/", f"{tmp_path}/") for a in argv]
        argv[argv.index("--address") + 1] = address
        return argv

    async def main():
        async with health_server(made) as (address, _):
            codes = []
            for d in ("tandem-prefill", "tandem-decode"):
                c = _container(d)
                for kind in PROBES:
                    argv = _probe_argv(c[kind])
                    assert argv[argv.index("--address") + 1].startswith("$POD_IP:")
                    codes.append(await asyncio.to_thread(
                        healthcheck.main, local(argv[1:], address)))
            # TLS trusting the CA, but no client certificate: refused in the handshake.
            bare = ["--address", address, "--tls-ca", str(made.ca),
                    "--cluster-server-name", SERVER_NAME]
            codes.append(await asyncio.to_thread(healthcheck.main, bare))
            router = build_parser("router").parse_args(
                [a.replace("/certs/", f"{tmp_path}/") for a in _container("tandem-router")["args"]])
            async with internal_channel(address, ClusterTls.from_args(router), ()) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
            return codes, reply.status

    codes, status = asyncio.run(main())
    assert codes == [0] * 6 + [1]
    assert status == health_pb2.HealthCheckResponse.SERVING
