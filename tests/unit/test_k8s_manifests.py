"""deploy/k8s: every manifest is valid against the Kubernetes API's JSON schemas (offline,
kubernetes-validate, strict: unknown fields are errors), and the pieces are wired together:
the router's worker addresses name Services whose ports lead to the workers' gRPC ports,
probes and scrape annotations name ports the containers serve, workers get a GPU each, and
prefill serves its pool over NIXL, and every hop between router and workers is mutual TLS with
the certificate of the pod's role, from a Secret of that role alone, which the workers' probes
present too. The router's public
side is test_k8s_public_tls.py."""

from __future__ import annotations

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
    KUBERNETES_VERSION,
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
    _keys,
    _mtls_problems,
    _mutations,
    _probe_argv,
    _probe_port,
    cluster_files,
)

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the dev extra: pip install -e '.[dev]'")


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
    # Readiness asks readiness and liveness liveness (grpc.health.v1's service names, or the
    # router's /health/ready and /health/live), never just an open port: a worker out must not
    # restart the router, nor one of several pull it out of its Service.
    for kind, asks in (("readinessProbe", "readiness"), ("startupProbe", None),
                       ("livenessProbe", "liveness")):
        probe = c[kind]
        argv = _probe_argv(probe)
        if argv is not None:
            asked = argv[argv.index("--service") + 1] if "--service" in argv else ""
        else:
            path = probe.get("httpGet", {}).get("path", "")
            asked = {"/health/ready": "readiness", "/health/live": "liveness"}.get(path, path)
        assert asked in ((asks,) if asks else ("readiness", "liveness")), (kind, probe)
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    metrics = int(annotations["prometheus.io/port"])
    served = int(_flag(args, "--metrics-port" if "--metrics-port" in args else "--http-port"))
    assert metrics == served == _container_port(c, metrics)
    # Drains within the grace the worker is given, before the kubelet's SIGKILL.
    grace = float(_flag(args, "--grace"))
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    pre_stop = c.get("lifecycle", {}).get("preStop")
    role = deployment.removeprefix("tandem-")
    if role in ("prefill", "decode"):
        # A worker pod drains before its SIGTERM: `tandem drain` on its own port with its own
        # role's certificate (the one a worker takes Drain from), answered within the
        # kubelet's grace, which outlasts the worker's --grace.
        drain = pre_stop["exec"]["command"][2].split()
        assert drain[:3] == ["exec", "tandem", "drain"]
        assert drain[3] == f'"$POD_IP:{grpc_port}"'
        assert _flag(drain, "--cluster-cert") == f"/certs/{role}.pem"
        assert _flag(drain, "--cluster-server-name") == f"{role}.tandem.internal"
        timeout = float(_flag(drain, "--timeout"))
        assert grace < timeout < d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    else:
        assert pre_stop is None


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


def test_workers_keep_triton_kernels_in_a_volume_of_the_pod() -> None:
    """TRITON_CACHE_DIR is a mounted emptyDir: a restarted container loads the kernels its
    start-up compiled (engine/warm_up.py) instead of compiling them again."""
    for deployment in ("tandem-prefill", "tandem-decode"):
        pod = _get("Deployment", deployment)["spec"]["template"]["spec"]
        c = _container(deployment)
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volume = mounts.get(env["TRITON_CACHE_DIR"])
        assert volume is not None, deployment
        assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[volume], deployment


def test_the_worker_and_router_flags_parse_with_the_cli() -> None:
    """Each container's args are a command line the `tandem` CLI accepts."""
    from tandem.cli.main import build_parser

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
    from tandem.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--model", "m", "--transport", "carrier-pigeon"])


@pytest.mark.parametrize("deployment", SERVICES)
def test_every_router_and_worker_speaks_mutual_tls_with_the_secret(deployment) -> None:
    assert _mtls_problems(_get("Deployment", deployment)) == []


@pytest.mark.parametrize("deployment,what,mutate", list(_mutations()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_mtls_check_catches_each_missing_piece(deployment, what, mutate) -> None:
    d = copy.deepcopy(_get("Deployment", deployment))
    pod = d["spec"]["template"]["spec"]
    mutate(pod["containers"][0], pod)
    assert _mtls_problems(d), what


@pytest.mark.parametrize("where", ["kustomization.yaml", "docs/deployment.md"])
def test_the_documented_secrets_are_the_ones_the_pods_mount(where) -> None:
    """Each Secret a pod mounts is made as documented, with the keys the pod reads: a cluster
    Secret per role with that role's certificate alone, all from one `tandem certs` run; the
    public one comes from another run (another CA: it opens nothing on the workers), and no key
    goes on kubectl's command line."""
    text = (K8S / where).read_text() if where != "docs/deployment.md" else _k8s_readme()
    doc = _documented(text)
    cluster_dirs = set()
    for d, secret in SECRETS.items():
        assert sorted(_keys(doc.generic[secret])) == sorted(cluster_files(ROLE[d]).values())
        cluster_dirs.add(_certs_dir(doc, doc.generic[secret]))
    (cluster_dir,) = cluster_dirs
    cert, key = doc.tls[PUBLIC_SECRET]  # `create secret tls` stores them as tls.crt, tls.key
    public_dir = _certs_dir(doc, [cert, key])
    assert public_dir != cluster_dir
    assert (PurePosixPath(cert).name, PurePosixPath(key).name) == ("router.pem", "router.key")
    assert _keys(doc.generic[KEY_SECRET]) == [KEY_FILE]
    assert "--from-literal" not in text  # `ps` shows kubectl's arguments
    mounted = {"tandem-prefill": {SECRETS["tandem-prefill"]},
               "tandem-decode": {SECRETS["tandem-decode"]},
               "tandem-router": {SECRETS["tandem-router"], PUBLIC_SECRET, KEY_SECRET}}
    for d, secrets in mounted.items():
        pod = _get("Deployment", d)["spec"]["template"]["spec"]
        assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == secrets


def test_autoscalers_scale_each_worker_deployment_on_the_routers_planner() -> None:
    """autoscaling.yaml: one HPA per worker Deployment, on the planner's desired replicas for
    that role, within the planner's own bounds; the router runs the planner with valid
    targets and scrapes as Prometheus reaches it."""
    from tandem.cli.main import build_parser
    from tandem.router_svc.server import planner_targets

    router_args = [re.sub(r"\$\((\w+)\)", "x", a) for a in _container("tandem-router")["args"]]
    targets = planner_targets(build_parser().parse_args(router_args))
    assert targets is not None
    for role in ("prefill", "decode"):
        hpa = _get("HorizontalPodAutoscaler", f"tandem-{role}")["spec"]
        assert hpa["scaleTargetRef"]["name"] == f"tandem-{role}"
        _get("Deployment", hpa["scaleTargetRef"]["name"])  # exists
        (metric,) = hpa["metrics"]
        assert metric["external"]["metric"]["name"] == "tandem_planner_desired_replicas"
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"role": role}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (targets.min_replicas,
                                                            targets.max_replicas)
