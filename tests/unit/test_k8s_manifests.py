"""deploy/k8s: every manifest is valid against the Kubernetes API's JSON schemas (offline,
kubernetes-validate, strict: unknown fields are errors), and the pieces are wired together:
the router's worker addresses name Services whose ports lead to the workers' gRPC ports,
probes and scrape annotations name ports the containers serve, workers get a GPU each, and
prefill serves its pool over NIXL, every hop between router and workers is mutual TLS with
the certificates of one Secret, which the workers' probes present too, and the router's public
ports serve TLS only, with the certificate of another Secret, to callers with a key from a third,
which is on no command line. The router started with the manifest's own flags (on loopback)
shows that last part holds on the wire."""

from __future__ import annotations

import asyncio
import copy
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import NamedTuple

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
    http_port = int(_flag(args, "--http-port")) if "--http-port" in args else None
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        # An HTTP probe asks the router's HTTP server; every other its gRPC port.
        want = http_port if "httpGet" in probe else grpc_port
        assert want is not None and _probe_port(c, probe) == want, (kind, probe)
        argv = _probe_argv(probe)
        if argv is not None:
            # `tandem health` answers within the kubelet's limit, so its exit code is what counts.
            timeout = float(argv[argv.index("--timeout") + 1])
            assert timeout < probe["timeoutSeconds"], (kind, probe)
            # The kubelet runs it without $(VAR) expansion of env from fields: sh expands it.
            assert f'"$POD_IP:{grpc_port}"' in probe["exec"]["command"][2]
    # grpc.health.v1 or the router's /health (which says what its gRPC health says), not just
    # an open port
    readiness = c["readinessProbe"]
    assert ("grpc" in readiness or _probe_argv(readiness) is not None
            or readiness.get("httpGet", {}).get("path") == "/health"), readiness
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


def _secret_mounts(pod: dict, c: dict, secret: str) -> tuple[dict[str, dict], list[str]]:
    """The container's mounts of volumes of Secret `secret`, by mount path, each with its
    volume's `secret` source, and what is wrong with them: none, one writable, an optional
    Secret (the pod would start without its files), files every user may read."""
    volumes = {v["name"]: v["secret"] for v in pod.get("volumes", [])
               if v.get("secret", {}).get("secretName") == secret}
    mounts = {m["mountPath"].rstrip("/"): {**m, "secret": volumes[m["name"]]}
              for m in c.get("volumeMounts", []) if m["name"] in volumes}
    problems = [] if mounts else [f"no volume of Secret {secret} is mounted"]
    for path, m in mounts.items():
        if not m.get("readOnly"):
            problems.append(f"{path} is not mounted read-only")
        if m["secret"].get("optional"):
            problems.append(f"{secret} is optional: a pod would start without its files")
        if m["secret"].get("defaultMode", 0o644) & 0o007:
            problems.append(f"{secret}'s files are readable by every user of the container")
    return mounts, problems


def _secret_file_problem(argv: list[str], flag: str, file: str, secret: str,
                         mounts: dict[str, dict], where: str) -> str | None:
    """What is wrong with `flag`'s path in argv: absent, or not the file `file` of a mount of
    `secret` (its key `file`, or an `items:` entry mapped to that name). None when right."""
    if flag not in argv:
        return f"{where}: no {flag}"
    path = PurePosixPath(_flag(argv, flag))
    mount = mounts.get(str(path.parent))
    if mount is None:
        return f"{where}: {flag} {path} is not under a mount of {secret}"
    items = mount["secret"].get("items")
    provided = {i["path"] for i in items} if items else {file}
    if path.name != file or path.name not in provided:
        return f"{where}: {flag} {path} is not the Secret's {file}"
    return None


def _mtls_problems(deployment: dict) -> list[str]:
    """What is missing for the pod to speak mutual TLS with the cluster Secret: the three
    certificate flags on its command line, each naming a file the Secret provides under a
    read-only mount of it, the agreed server name, and (workers, whose gRPC port asks callers
    for a certificate) the same on every probe. Empty when all is there."""
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts, problems = _secret_mounts(pod, c, SECRET)

    def check(argv: list[str], where: str) -> None:
        for flag, file in CLUSTER_FILES.items():
            problem = _secret_file_problem(argv, flag, file, SECRET, mounts, where)
            if problem:
                problems.append(problem)
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


class Documented(NamedTuple):
    """The commands a text documents: `tandem certs` runs (--out directory -> its --hosts),
    `kubectl create secret generic` (name -> its --from-file sources) and `kubectl create
    secret tls` (name -> the --cert and --key paths)."""

    certs: dict[str, list[str]]
    generic: dict[str, list[str]]
    tls: dict[str, tuple[str, str]]


def _documented(text: str) -> Documented:
    text = text.replace("\n#", "\n").replace("\\\n", " ")  # comments, continued lines
    doc = Documented(
        {m[1]: m[2].split(",")
         for m in re.finditer(r"tandem certs --out (\S+) --hosts (\S+)", text)},
        {m[1]: re.findall(r"--from-file=(\S+)", m[2]) for m in re.finditer(r"create secret generic (\S+)((?: +--from-file=\S+)+)", text)},
        {m[1]: (m[2], m[3])
         for m in re.finditer(r"create secret tls (\S+) --cert=(\S+) --key=(\S+)", text)})
    assert doc.certs and doc.generic and doc.tls, "no `tandem certs` and `kubectl create secret`"
    return doc


def _k8s_readme() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Deploying on Kubernetes", 1)[1].split("\n## ", 1)[0]


def _keys(sources: list[str]) -> list[str]:
    """The Secret's keys: --from-file=[KEY=]PATH is KEY, else the file's name."""
    return [f.split("=", 1)[0] if "=" in f else PurePosixPath(f).name for f in sources]


def _certs_dir(doc: Documented, files: list[str]) -> str:
    """The `tandem certs --out` directory the documented files come from."""
    (out,) = {str(PurePosixPath(f).parent) for f in files}
    assert out in doc.certs, f"{files} come from no documented `tandem certs` run"
    return out


@pytest.mark.parametrize("where", ["kustomization.yaml", "README.md"])
def test_the_documented_secrets_are_the_ones_the_pods_mount(where) -> None:
    """Each Secret a pod mounts is made as documented, with the keys the pod reads; the cluster
    certificate carries the agreed name, the public one comes from another `tandem certs` run
    (another CA: it opens nothing on the workers), and no key goes on kubectl's command line."""
    text = (K8S / where).read_text() if where != "README.md" else _k8s_readme()
    doc = _documented(text)
    assert sorted(_keys(doc.generic[SECRET])) == sorted(CLUSTER_FILES.values())
    cluster_dir = _certs_dir(doc, doc.generic[SECRET])
    assert SERVER_NAME in doc.certs[cluster_dir]
    cert, key = doc.tls[PUBLIC_SECRET]  # `create secret tls` stores them as tls.crt, tls.key
    public_dir = _certs_dir(doc, [cert, key])
    assert public_dir != cluster_dir
    assert (PurePosixPath(cert).name, PurePosixPath(key).name) == ("node.pem", "node.key")
    assert _keys(doc.generic[KEY_SECRET]) == [KEY_FILE]
    assert "--from-literal" not in text  # `ps` shows kubectl's arguments
    mounted = {"tandem-prefill": {SECRET}, "tandem-decode": {SECRET},
               "tandem-router": {SECRET, PUBLIC_SECRET, KEY_SECRET}}
    for d, secrets in mounted.items():
        pod = _get("Deployment", d)["spec"]["template"]["spec"]
        assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == secrets


# -- the router's public ports: TLS only, API keys from a Secret ---------------------------------
PUBLIC_SECRET = "tandem-router-tls"  # kubernetes.io/tls
PUBLIC_FILES = {"--tls-cert": "tls.crt", "--tls-key": "tls.key"}
KEY_SECRET = "tandem-api-key"
KEY_FILE = "api-key"


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
        c["args"].index("--tls-key") + 1, "/certs/node.key")
    yield "key file not the Secret's", lambda c, p, m: c["args"].__setitem__(
        c["args"].index("--tls-key") + 1, "/tls/node.key")
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

    from cli import health as healthcheck
    from cli.certs import make_cluster_ca
    from cli.main import build_parser
    from runtime.security import ClusterTls, internal_channel

    doc = _documented(_k8s_readme())
    made = make_cluster_ca(tmp_path, doc.certs[_certs_dir(doc, doc.generic[SECRET])])

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

    from cli.certs import make_cluster_ca
    from cli.main import build_parser
    from engine.demo import build_demo_checkpoint
    from router_svc.server import serve
    from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

    doc = _documented(_k8s_readme())
    cluster_dir = _certs_dir(doc, doc.generic[SECRET])
    cluster = make_cluster_ca(tmp_path / "certs", doc.certs[cluster_dir])
    cert, key = doc.tls[PUBLIC_SECRET]
    public = make_cluster_ca(tmp_path / "public", doc.certs[_certs_dir(doc, [cert, key])])
    (tmp_path / "tls").mkdir()  # what `kubectl create secret tls` mounts
    shutil.copy(public.cert, tmp_path / "tls" / PUBLIC_FILES["--tls-cert"])
    shutil.copy(public.key, tmp_path / "tls" / PUBLIC_FILES["--tls-key"])
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
        creds = cluster.server_credentials()
        ports = [worker.add_secure_port("127.0.0.1:0", creds) for _ in range(2)]
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
