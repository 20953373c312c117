"""deploy/k8s: every manifest is valid against the Kubernetes API's JSON schemas (offline,
kubernetes-validate, strict: unknown fields are errors), and the pieces are wired together:
the router's worker addresses name Services whose ports lead to the workers' gRPC ports,
probes and scrape annotations name ports the containers serve, workers get a GPU each, and
prefill serves its pool over NIXL."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the dev extra: pip install -e '.[dev]'")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
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
        (how,) = {"grpc", "tcpSocket", "httpGet"} & probe.keys()
        assert _container_port(c, probe[how]["port"]) == grpc_port, (kind, probe)
    assert "grpc" in c["readinessProbe"]  # grpc.health.v1, not just an open port
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
