"""docker-compose.yml, checked offline (no Docker engine): the Compose Specification schema, the
GPU and namespace layout CUDA IPC needs, health checks and start order, what is published, and
every Tandem command parsed by the real `tandem` CLI parser, so compose and the CLI cannot drift
apart."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tandem.cli import health as healthcheck
from tandem.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
OBSERVE = ROOT / "deploy" / "compose.observe.yml"
GPU_PER_WORKER = ROOT / "deploy" / "compose.gpu-per-worker.yml"
# The clone sits beside shared/ (here and in CI).
SCHEMA = Path(__file__).resolve().parents[3] / "shared" / "data" / "compose-spec.json"

TANDEM = ("prefill", "decode", "router")  # service name == `tandem` subcommand
WORKERS = ("prefill", "decode")
# Both workers see both GPUs (docker-compose.yml, "GPU layout", says why).
GPUS = {"prefill": ["0", "1"], "decode": ["0", "1"]}
ENV = {"TANDEM_MODEL_DIR": "Llama-3.1-8B-Instruct"}


# ---- loading -------------------------------------------------------------------------------------
class _ComposeLoader(yaml.SafeLoader):
    """safe_load plus Compose's merge tags (!override, !reset), read as the plain value."""


def _plain(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_ComposeLoader.add_multi_constructor("!override", _plain)
_ComposeLoader.add_multi_constructor("!reset", _plain)

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>\w+)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_]\w*))")


class MissingVariable(KeyError):
    pass


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error},
    ${VAR:+alt}, ${VAR+alt} and $$, applied to every string value."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m["escaped"]:
            return "$"
        name = m["name"] or m["bare"]
        op, arg = m["op"] or "", m["arg"] or ""
        current = env.get(name)
        empty = current is None or (op.startswith(":") and current == "")
        if op.endswith("-"):
            return arg if empty else current
        if op.endswith("?"):
            if empty:
                raise MissingVariable(f"{name}: {arg}")
            return current
        if op.endswith("+"):
            return "" if empty else arg
        return current or ""

    return _VAR.sub(sub, value)


def load(path: Path = COMPOSE) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


@pytest.fixture(scope="module")
def raw() -> dict:
    return load()


@pytest.fixture(scope="module")
def doc(raw: dict) -> dict:
    return interpolate(raw, ENV)


@pytest.fixture(scope="module")
def services(doc: dict) -> dict:
    return doc["services"]


def parse(argv: list[str]):
    """The real `tandem` parser; a refused flag fails the test with argparse's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`tandem {shlex.join(argv)}` is refused by the CLI:\n{err.getvalue()}")


def read(argv: list[str]):
    """The values the `tandem` parser gives the flags it knows. Only
    test_every_command_is_accepted_by_the_cli insists that it knows them all, so one new flag
    fails one test, not every test that needs a port."""
    return build_parser().parse_known_args(argv)[0]


def read_probe(argv: list[str]):
    """`tandem health ...` as cli.health parses it."""
    parser = argparse.ArgumentParser(prog="tandem")
    healthcheck.add_parser(parser.add_subparsers(dest="command", required=True), "health")
    return parser.parse_args(argv)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def args(services: dict) -> dict:
    return {name: read(services[name]["command"]) for name in TANDEM}


def seconds(duration: str) -> float:
    """A Compose duration ("45s", "1m30s", "15m", "500ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def grpc_port(name: str, a) -> int:
    return a.grpc_port if name == "router" else a.port


# ---- the schema ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPOSE, OBSERVE, GPU_PER_WORKER], ids=lambda p: p.name)
def test_validates_against_the_compose_specification(path: Path) -> None:
    if not SCHEMA.is_file():
        pytest.skip(f"no Compose Specification schema at {SCHEMA} (shared/ is not beside the repo)")
    from jsonschema import Draft7Validator

    validator = Draft7Validator(json.loads(SCHEMA.read_text()))
    document = yaml.safe_load(path.read_text()) if path == COMPOSE else load(path)
    for candidate in (document, interpolate(document, ENV)):
        errors = sorted(validator.iter_errors(candidate), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_model_directory_is_required(raw: dict) -> None:
    with pytest.raises(MissingVariable, match="TANDEM_MODEL_DIR"):
        interpolate(raw, {})


# ---- commands, parsed by the CLI -----------------------------------------------------------------
COMMANDS = [(name, ("command",)) for name in TANDEM] + \
           [(name, ("healthcheck", "test")) for name in TANDEM]


@pytest.mark.parametrize(("name", "where"), COMMANDS, ids=lambda v: v if isinstance(v, str)
                         else v[0])
def test_every_command_is_accepted_by_the_cli(services: dict, name: str, where) -> None:
    argv = services[name]
    for key in where:
        argv = argv[key]
    if where == ("healthcheck", "test"):
        assert argv[:2] == ["CMD", "tandem"], f"{name}: exec `tandem`, no shell"
        argv = argv[2:]
    parse(argv)


def test_the_commands_say_what_the_layout_needs(args: dict, services: dict) -> None:
    assert {name: a.command for name, a in args.items()} == {n: n for n in TANDEM}
    for name, a in args.items():
        assert a.model == f"/models/{ENV['TANDEM_MODEL_DIR']}", name
        assert a.host == "0.0.0.0", f"{name} must listen beyond the container's loopback"
    p, d, r = args["prefill"], args["decode"], args["router"]
    assert (p.port, d.port, r.grpc_port, r.http_port) == (50061, 50062, 50051, 8000)
    assert p.transport == "cuda_ipc"
    assert r.served_model_name == ENV["TANDEM_MODEL_DIR"]
    assert [flag(services[n]["command"], "--metrics-port") for n in WORKERS] == ["9101", "9102"]


def test_the_router_lists_each_worker_by_a_name_that_resolves(services: dict, args: dict) -> None:
    r = args["router"]
    listed = {"prefill": [a for v in r.prefill or [] for a in v.split(",")],
              "decode": [a for v in r.decode or [] for a in v.split(",")]}
    assert listed == {"prefill": ["prefill:50061"], "decode": ["decode:50062"]}
    for role, addresses in listed.items():
        for address in addresses:
            host, port = address.rsplit(":", 1)
            assert args[host].command == role and args[host].port == int(port), address
    for name in WORKERS:
        # A prefill worker hands decode workers HOSTNAME:PORT as its address.
        assert services[name]["hostname"] == name


def test_stop_grace_period_outlasts_the_drain(services: dict, args: dict) -> None:
    for name in TANDEM:
        assert seconds(services[name]["stop_grace_period"]) > args[name].grace + 5, name


# ---- GPUs and namespaces -------------------------------------------------------------------------
def _device_index(device: str) -> int:
    m = re.fullmatch(r"cuda:(\d+)", device)
    assert m, f"--device {device}: name the GPU (cuda:N)"
    return int(m[1])


def _physical_gpu(service: dict, device: str) -> str:
    (request,) = service["deploy"]["resources"]["reservations"]["devices"]
    return request["device_ids"][_device_index(device)]


def test_each_worker_reserves_its_gpus(services: dict, args: dict) -> None:
    for name in WORKERS:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": GPUS[name],
                            "capabilities": ["gpu"]}], name
    assert _physical_gpu(services["prefill"], args["prefill"].device) == "0"
    assert _physical_gpu(services["decode"], args["decode"].device) == "1"
    for name in ("router", "otel-collector", "jaeger", "prometheus"):
        assert "deploy" not in services[name] and "gpus" not in services[name], name


def test_gpu_per_worker_override_gives_each_worker_one_gpu(raw: dict) -> None:
    """The documented switch: the override file plus TANDEM_DECODE_DEVICE=cuda:0."""
    override = load(GPU_PER_WORKER)["services"]
    merged = interpolate(raw, {**ENV, "TANDEM_DECODE_DEVICE": "cuda:0"})["services"]
    for name, gpu in (("prefill", "0"), ("decode", "1")):
        devices = override[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
        merged[name]["deploy"] = override[name]["deploy"]
        a = read(merged[name]["command"])
        assert _physical_gpu(merged[name], a.device) == gpu, name
    # `!override` replaces the list; without it Compose would append a second request.
    assert GPU_PER_WORKER.read_text().count("devices: !override") == 2


def test_workers_share_ipc_and_pid_with_each_other_not_the_host(services: dict) -> None:
    assert services["prefill"]["ipc"] == "shareable"
    assert services["decode"]["ipc"] == "service:prefill"
    assert services["decode"]["pid"] == "service:prefill"
    for name, s in services.items():
        assert s.get("ipc") != "host" and s.get("pid") != "host", name
        assert s.get("network_mode") != "host" and not s.get("privileged"), name
    assert "ipc" not in services["router"] and "pid" not in services["router"]


# ---- health and start order ----------------------------------------------------------------------
def test_every_tandem_service_is_health_checked_with_tandem_health(services: dict,
                                                                   args: dict) -> None:
    for name in TANDEM:
        check = services[name]["healthcheck"]
        test = check["test"]
        assert test[:3] == ["CMD", "tandem", "health"], name
        probe = read_probe(test[2:])
        assert probe.address == f"127.0.0.1:{grpc_port(name, args[name])}", name
        # depends_on waits for readiness; the router stays healthy with one worker restarting.
        assert probe.service == "readiness", name
        assert seconds(check["timeout"]) > probe.timeout, name
        assert seconds(check["start_period"]) >= 300, f"{name}: a large model loads for minutes"


def test_start_order_waits_for_health(services: dict) -> None:
    def waits_for(name: str) -> dict[str, str]:
        deps = services[name].get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: long syntax, with a condition"
        return {dep: spec["condition"] for dep, spec in deps.items()}

    certs = {"certs": "service_completed_successfully"}  # the cluster's TLS files first
    assert waits_for("router") == {**certs, "prefill": "service_healthy",
                                   "decode": "service_healthy"}
    assert waits_for("decode") == {**certs, "prefill": "service_healthy"}
    assert waits_for("prefill") == certs
    for name in TANDEM:
        assert services[name]["restart"] in ("unless-stopped", "always", "on-failure"), name


def test_a_restarted_worker_comes_back_where_the_router_and_its_peers_look(services: dict,
                                                                          args: dict) -> None:
    """Compose's side of supervision: a container that exits is restarted (its restart
    policy), on its fixed port under its service name, so the router's worker list stays
    valid; the router takes it back in when it answers its poll (`tandem up` does the same
    with cli/supervisor.py). decode lives in prefill's namespaces and maps prefill's
    pool: it is restarted with prefill."""
    for name in TANDEM:
        assert services[name]["restart"] in ("unless-stopped", "always", "on-failure"), name
        assert grpc_port(name, args[name]) != 0, f"{name} must come back on its own port"
        assert "test" in services[name]["healthcheck"], name
    assert services["decode"]["depends_on"]["prefill"]["restart"] is True
    # Docker restarts a container whose process exits, not one that hangs: the router's
    # poll finds a hung worker (--worker-timeout) and moves its streams.
    assert args["router"].worker_timeout <= 15 and args["router"].max_migrations >= 1


# ---- what is published and mounted ---------------------------------------------------------------
def test_only_the_router_publishes_ports(services: dict, args: dict) -> None:
    assert [name for name, s in services.items() if s.get("ports")] == ["router"]
    published = {}
    for spec in services["router"]["ports"]:
        host_ip, host_port, container_port = str(spec).rsplit(":", 2)
        published[int(container_port)] = (host_ip, int(host_port))
    r = args["router"]
    assert published == {r.http_port: ("127.0.0.1", 8000), r.grpc_port: ("127.0.0.1", 50051)}


def test_observe_override_publishes_the_uis_on_loopback_only(services: dict) -> None:
    ports = {name: s["ports"] for name, s in load(OBSERVE)["services"].items()}
    assert ports == {"jaeger": ["127.0.0.1:16686:16686"], "prometheus": ["127.0.0.1:9090:9090"]}
    assert not services["jaeger"].get("ports") and not services["prometheus"].get("ports")


def test_the_model_directory_is_mounted_read_only(services: dict) -> None:
    for name in TANDEM:
        volumes = services[name]["volumes"]
        # ${TANDEM_MODELS:-./models}; the cluster's certificates, read-only too; Triton's
        # kernel cache, where TRITON_CACHE_DIR points
        assert volumes == ["./models:/models:ro", "tandem-certs:/certs:ro",
                           "tandem-kernels:/kernel-cache"], name
        assert services[name]["environment"]["TRITON_CACHE_DIR"] == "/kernel-cache", name


def test_every_internal_hop_is_mutual_tls(services: dict, args: dict) -> None:
    """The certs service writes a CA and a certificate per role, naming every service too; each
    Tandem service serves and calls with its role's, and its health check presents it (a worker
    refuses a caller without one)."""
    certs = services["certs"]
    cmd = certs["command"]
    assert cmd[0] == "certs" and certs["restart"] == "no"
    hosts = cmd[cmd.index("--hosts") + 1].split(",")
    assert set(TANDEM) <= set(hosts)
    assert certs["volumes"] == ["tandem-certs:/certs"]
    for name in TANDEM:
        a = args[name]
        assert (a.cluster_ca, a.cluster_cert, a.cluster_key) == (
            "/certs/ca.pem", f"/certs/{name}.pem", f"/certs/{name}.key"), name
        if name != "router":  # the router's public port is checked as clients see it
            test = services[name]["healthcheck"]["test"]
            assert "--cluster-cert" in test and f"/certs/{name}.pem" in test, name


def test_mounted_config_files_exist(services: dict) -> None:
    for name, s in services.items():
        for spec in s.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith("./") and source != "./models":
                assert (ROOT / source).is_file(), f"{name} mounts a missing {source}"


# ---- tracing and metrics -------------------------------------------------------------------------
def test_tandem_services_send_traces_to_the_collector(services: dict) -> None:
    names = set()
    for name in TANDEM:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
        names.add(env["OTEL_SERVICE_NAME"])
    assert names == {"tandem-prefill", "tandem-decode", "tandem-router"}
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    exporters = collector["service"]["pipelines"]["traces"]["exporters"]
    assert [collector["exporters"][e]["endpoint"] for e in exporters] == ["jaeger:4317"]
    assert "jaegertracing/" in services["jaeger"]["image"]


def test_prometheus_scrapes_every_tandem_service(services: dict, args: dict) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    scraped = {(target, job.get("metrics_path", "/metrics"))
               for job in config["scrape_configs"]
               for static in job["static_configs"] for target in static["targets"]}
    workers = {(f"{n}:{flag(services[n]['command'], '--metrics-port')}", "/metrics")
               for n in WORKERS}
    assert scraped == {(f"router:{args['router'].http_port}", "/metrics"), *workers}


# ---- the image -----------------------------------------------------------------------------------
def test_the_image_runs_tandem_as_a_non_root_user() -> None:
    text = (ROOT / "Dockerfile").read_text()
    final_stage = text[text.rindex("\nFROM "):]
    assert 'ENTRYPOINT ["tandem"]' in final_stage
    users = re.findall(r"^USER\s+(\S+)", final_stage, flags=re.M)
    assert users and users[-1] not in ("root", "0")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"models/", ".git/", ".venv/", "*.whl"} <= set(ignored)
