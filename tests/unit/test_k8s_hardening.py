"""deploy/k8s, what a pod may do and who may reach it: no service-account token, no privilege
escalation, no capabilities, a read-only root with emptyDir volumes wherever the processes
write; and NetworkPolicies, evaluated here as the API defines them, that let through exactly
the connections each RPC needs (router to workers, decode to prefill, NIXL between them,
clients to the router, Prometheus to the metrics ports) and nothing else. The manifests'
schema validation is test_k8s_manifests.py's (networkpolicy.yaml is a resource like the rest)."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
from k8s_manifests import DOCS, _container, _container_port, _flag, _get

DEPLOYMENTS = ("tandem-router", "tandem-prefill", "tandem-decode")
POLICIES = [d for d in DOCS if d["kind"] == "NetworkPolicy"]


# -- pods -----------------------------------------------------------------------------------------
def _pod(deployment: str) -> dict:
    return _get("Deployment", deployment)["spec"]["template"]["spec"]


def _pod_problems(pod: dict) -> list[str]:
    problems = []
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("the service account's token is mounted")
    ctx = pod.get("securityContext", {})
    if not ctx.get("runAsNonRoot") or ctx.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        problems.append("not non-root with the runtime's seccomp profile")
    for c in pod["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: privilege escalation allowed")
        if sc.get("privileged"):
            problems.append(f"{c['name']}: privileged")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or sc["capabilities"].get("add"):
            problems.append(f"{c['name']}: capabilities not all dropped")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{c['name']}: writable root filesystem")
    return problems


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_each_pod_runs_with_no_token_no_capabilities_and_a_read_only_root(deployment) -> None:
    assert _pod_problems(_pod(deployment)) == []


@pytest.mark.parametrize("change", [
    lambda pod: pod.pop("automountServiceAccountToken"),
    lambda pod: pod["securityContext"].pop("seccompProfile"),
    lambda pod: pod["containers"][0]["securityContext"].__setitem__(
        "allowPrivilegeEscalation", True),
    lambda pod: pod["containers"][0]["securityContext"]["capabilities"].__setitem__(
        "add", ["NET_ADMIN"]),
    lambda pod: pod["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"),
])
def test_the_pod_check_catches_each_missing_setting(change) -> None:
    pod = copy.deepcopy(_pod("tandem-prefill"))
    change(pod)
    assert _pod_problems(pod)


def _writable_dirs(deployment: str) -> set[str]:
    """Where the container's processes write: temporary files, the image user's home (its
    caches: TANDEM_CACHE_DIR and TRITON_CACHE_DIR in the Dockerfile), and the cache and
    shared-memory directories the manifest itself names."""
    c = _container(deployment)
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    dirs = {"/tmp", "/home/tandem"}
    if env.get("TRITON_CACHE_DIR"):
        dirs.add(env["TRITON_CACHE_DIR"])
    if c["args"][0] in ("prefill", "decode", "worker"):
        dirs.add("/dev/shm")  # UCX's and torch's shared memory
    return dirs


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_every_place_the_processes_write_is_a_writable_empty_dir(deployment) -> None:
    pod = _pod(deployment)
    (c,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in _writable_dirs(deployment):
        mount = next((mounts[p] for p in sorted(mounts, key=len, reverse=True)
                      if path == p or path.startswith(p.rstrip("/") + "/")), None)
        assert mount is not None, f"{deployment}: {path} is on the read-only root"
        assert not mount.get("readOnly"), (deployment, path)
        assert "emptyDir" in volumes[mount["name"]], (deployment, path)


# -- network policies -----------------------------------------------------------------------------
class Peer(NamedTuple):
    """A pod that opens a connection: its labels and its namespace's."""

    labels: dict
    namespace_labels: dict


def _labels(deployment: str) -> dict:
    return _get("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


ROUTER, PREFILL, DECODE = (Peer(_labels(d), {}) for d in DEPLOYMENTS)
PROMETHEUS = Peer({"app.kubernetes.io/name": "prometheus"}, {"name": "monitoring"})
OTHER = Peer({"app": "something-else"}, {})  # any other pod of the namespace
CLIENT = Peer({"app": "a-client"}, {"name": "elsewhere"})


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # all these manifests use
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(rule_peer: dict, src: Peer) -> bool:
    """A `from` entry, as the API reads it: podSelector alone is the policy's namespace;
    namespaceSelector (with or without podSelector) any matching namespace."""
    if "namespaceSelector" in rule_peer:
        if not _selects(rule_peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace_labels:  # from another namespace: only a namespaceSelector admits it
        return False
    return _selects(rule_peer.get("podSelector", {}), src.labels)


def _port_matches(rule_port: dict, dst_container: dict, port: int) -> bool:
    start = _container_port(dst_container, rule_port["port"]) \
        if isinstance(rule_port["port"], str) else rule_port["port"]
    return start <= port <= rule_port.get("endPort", start)


def allowed(src: Peer, deployment: str, port: int, policies: list[dict] = POLICIES) -> bool:
    """Whether `src` may connect to `deployment`'s pods on `port`: allowed when no policy
    selects the pods, else when a rule of one that does admits source and port."""
    dst = _labels(deployment)
    container = _container(deployment)
    selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], dst)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            peers_ok = "from" not in rule or any(_peer_matches(f, src) for f in rule["from"])
            ports_ok = "ports" not in rule or any(_port_matches(p, container, port)
                                                  for p in rule["ports"])
            if peers_ok and ports_ok:
                return True
    return False


def _port(deployment: str, flag: str) -> int:
    return int(_flag(_container(deployment)["args"], flag))


NIXL = 41234  # a port UCX's TCP listener may take (the kernel's ephemeral range)


def _matrix() -> list[tuple[str, Peer, str, int, bool]]:
    router_grpc, router_http = _port("tandem-router", "--grpc-port"), \
        _port("tandem-router", "--http-port")
    prefill, decode = _port("tandem-prefill", "--port"), _port("tandem-decode", "--port")
    p_metrics, d_metrics = (_port(d, "--metrics-port") for d in ("tandem-prefill",
                                                                   "tandem-decode"))
    names = {"router": ROUTER, "prefill": PREFILL, "decode": DECODE, "prometheus": PROMETHEUS,
             "other": OTHER, "client": CLIENT}
    want = {
        # what the RPCs and the transfers need
        ("client", "tandem-router", router_grpc): True,
        ("client", "tandem-router", router_http): True,
        ("router", "tandem-prefill", prefill): True,
        ("router", "tandem-decode", decode): True,
        ("decode", "tandem-prefill", prefill): True,
        ("decode", "tandem-prefill", NIXL): True,
        ("prefill", "tandem-decode", NIXL): True,
        ("prometheus", "tandem-prefill", p_metrics): True,
        ("prometheus", "tandem-decode", d_metrics): True,
        # and nothing else
        ("other", "tandem-prefill", prefill): False,
        ("other", "tandem-decode", decode): False,
        ("client", "tandem-prefill", prefill): False,
        ("client", "tandem-decode", NIXL): False,
        ("prefill", "tandem-decode", decode): False,
        ("prefill", "tandem-prefill", prefill): False,
        ("decode", "tandem-decode", decode): False,
        ("decode", "tandem-decode", NIXL): False,
        ("router", "tandem-prefill", NIXL): False,
        ("router", "tandem-decode", d_metrics): False,
        ("other", "tandem-prefill", p_metrics): False,
        ("client", "tandem-router", 22): False,
    }
    return [(f"{s}->{d.removeprefix('tandem-')}:{port}", names[s], d, port, ok)
            for (s, d, port), ok in want.items()]


@pytest.mark.parametrize("case", _matrix(), ids=lambda c: c[0])
def test_network_policies_let_through_what_each_rpc_needs_and_nothing_else(case) -> None:
    _, src, deployment, port, want = case
    assert allowed(src, deployment, port) is want


def test_every_tandem_pod_is_under_a_default_deny() -> None:
    """Without the policies every connection would be allowed: the evaluator says so, and
    every pod is selected by a policy with no rule at all."""
    assert all(allowed(OTHER, d, 1, policies=[]) for d in DEPLOYMENTS)
    deny = [p for p in POLICIES if not p["spec"].get("ingress")]
    for d in DEPLOYMENTS:
        assert any(_selects(p["spec"]["podSelector"], _labels(d)) for p in deny), d
