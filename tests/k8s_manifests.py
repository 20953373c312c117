"""deploy/k8s as the manifest tests read it: every document, lookups by kind and name, a
container's flags, ports and probes, and the cluster mutual-TLS pieces (the Secret, its
files and how a pod mounts them, the deployment guide's commands that create it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import yaml

ROOT = Path(__file__).resolve().parents[1]


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
        from tandem.cli.main import build_parser

        return int(build_parser("health").parse_args(argv).address.rsplit(":", 1)[1])
    (how,) = {"grpc", "tcpSocket", "httpGet"} & probe.keys()
    return _container_port(c, probe[how]["port"])


# -- mutual TLS between router and workers -------------------------------------------------------
SERVICES = ("tandem-prefill", "tandem-decode", "tandem-router")
ROLE = {"tandem-prefill": "prefill", "tandem-decode": "decode", "tandem-router": "router"}
# A Secret per role, holding the CA's certificate and that role's certificate and key only.
SECRETS = {d: f"tandem-{role}-cluster-tls" for d, role in ROLE.items()}


def cluster_files(role: str) -> dict[str, str]:
    """Each certificate flag and the file (a key of the role's Secret) it names."""
    return {"--cluster-ca": "ca.pem", "--cluster-cert": f"{role}.pem",
            "--cluster-key": f"{role}.key"}


def server_name(role: str) -> str:
    """The name a probe of a worker of `role` (dialed by pod IP) checks in its certificate."""
    return f"{role}.tandem.internal"


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
    """What is missing for the pod to speak mutual TLS with its role's Secret: the three
    certificate flags on its command line, each naming a file of that Secret (its role's
    certificate) under a read-only mount of it, and (workers, whose gRPC port asks callers for a
    certificate) the same on every probe, which checks the role's name in the certificate of
    the pod it dials by IP. Empty when all is there."""
    name = deployment["metadata"]["name"]
    role, secret = ROLE[name], SECRETS[name]
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts, problems = _secret_mounts(pod, c, secret)

    def check(argv: list[str], where: str) -> None:
        for flag, file in cluster_files(role).items():
            problem = _secret_file_problem(argv, flag, file, secret, mounts, where)
            if problem:
                problems.append(problem)

    check(c["args"], c["name"])
    if c["args"][0] in ("prefill", "decode", "worker"):
        for kind in PROBES:
            argv = _probe_argv(c[kind])
            if argv is None:
                problems.append(f"{kind} presents no client certificate")
                continue
            check(argv, kind)
            name = argv[argv.index("--cluster-server-name") + 1] \
                if "--cluster-server-name" in argv else None
            if name != server_name(role):
                problems.append(f"{kind}: --cluster-server-name is {name!r}, not "
                                f"{server_name(role)!r}")
    return problems


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
        for flag in cluster_files(ROLE[d]):
            yield d, f"args without {flag}", lambda c, p, f=flag: _without_flag(c["args"], f)
        other = "decode" if ROLE[d] != "decode" else "prefill"
        yield d, "another role's certificate", lambda c, p, o=other: c["args"].__setitem__(
            c["args"].index("--cluster-cert") + 1, f"/certs/{o}.pem")
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
        yield d, "key outside the mount", lambda c, p, r=ROLE[d]: c["args"].__setitem__(
            c["args"].index("--cluster-key") + 1, f"/etc/{r}.key")
        yield d, "key file not the Secret's", lambda c, p: c["args"].__setitem__(
            c["args"].index("--cluster-key") + 1, "/certs/tls.key")
    for d in ("tandem-prefill", "tandem-decode"):
        for flag in (*cluster_files(ROLE[d]), "--cluster-server-name"):
            yield d, f"probe without {flag}", lambda c, p, f=flag: _probe_without(f)(c)
        yield d, "kubelet's gRPC probe", lambda c, p: c.__setitem__(
            "livenessProbe", {"grpc": {"port": c["ports"][0]["containerPort"]}})


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
        {m[1]: m[2].split(",") if m[2] else []
         for m in re.finditer(r"tandem certs --out (\S+)(?: --hosts (\S+))?", text)},
        {m[1]: re.findall(r"--from-file=(\S+)", m[2]) for m in re.finditer(r"create secret generic (\S+)((?: +--from-file=\S+)+)", text)},
        {m[1]: (m[2], m[3])
         for m in re.finditer(r"create secret tls (\S+) --cert=(\S+) --key=(\S+)", text)})
    assert doc.certs and doc.generic and doc.tls, "no `tandem certs` and `kubectl create secret`"
    return doc


def _k8s_readme() -> str:
    """The Kubernetes section of the deployment guide (docs/deployment.md)."""
    guide = (ROOT / "docs" / "deployment.md").read_text()
    return guide.split("## Kubernetes", 1)[1].split("\n## ", 1)[0]


def _keys(sources: list[str]) -> list[str]:
    """The Secret's keys: --from-file=[KEY=]PATH is KEY, else the file's name."""
    return [f.split("=", 1)[0] if "=" in f else PurePosixPath(f).name for f in sources]


def _certs_dir(doc: Documented, files: list[str]) -> str:
    """The `tandem certs --out` directory the documented files come from."""
    (out,) = {str(PurePosixPath(f).parent) for f in files}
    assert out in doc.certs, f"{files} come from no documented `tandem certs` run"
    return out


# The router's public ports: TLS only, API keys from a Secret.
PUBLIC_SECRET = "tandem-router-tls"  # kubernetes.io/tls
PUBLIC_FILES = {"--tls-cert": "tls.crt", "--tls-key": "tls.key"}
KEY_SECRET = "tandem-api-key"
KEY_FILE = "api-key"
