"""`tandem health` against a real grpc.aio server with a health servicer: the exit code is what a
container health check (docker-compose.yml) acts on."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from grpc_health.v1 import health_pb2
from health_server import health_server

from tandem.cli import health as healthcheck
from tandem.cli.launcher import free_port

WORKER = "tandem.v1.Worker"
Status = health_pb2.HealthCheckResponse


def _tandem_health(argv: list[str]) -> int:
    """Parse as the `tandem` CLI does (add_parser on a subparsers action) and run."""
    parser = argparse.ArgumentParser(prog="tandem")
    healthcheck.add_parser(parser.add_subparsers(dest="command", required=True), "health")
    args = parser.parse_args(["health", *argv])
    return args.func(args)


async def _serve(statuses: dict[str, int], probes: list[list[str]]) -> list[int]:
    """Serve health with `statuses` set, run each probe (argv after `tandem health`, with
    {addr} replaced by the server's address) in a thread, and return their exit codes."""
    async with health_server() as (address, servicer):
        for name, status in statuses.items():
            await servicer.set(name, status)
        codes = []
        for argv in probes:
            argv = [a.replace("{addr}", address) for a in argv]
            # The client is synchronous: run it off the loop that serves it.
            codes.append(await asyncio.to_thread(_tandem_health, argv))
        return codes


def test_serving_exits_0_and_prints_the_status(capsys) -> None:
    codes = asyncio.run(_serve({"": Status.SERVING, WORKER: Status.SERVING},
                               [["--address", "{addr}"],
                                ["--address", "{addr}", "--service", WORKER]]))
    assert codes == [0, 0]
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("(server): SERVING") and out[1].endswith(f"{WORKER}: SERVING")


def test_not_serving_exits_1(capsys) -> None:
    # What a worker reports between SIGTERM and the end of its grace period.
    codes = asyncio.run(_serve({"": Status.NOT_SERVING, WORKER: Status.NOT_SERVING},
                               [["--address", "{addr}"],
                                ["--address", "{addr}", "--service", WORKER]]))
    assert codes == [1, 1]
    assert capsys.readouterr().out.count(": NOT_SERVING") == 2


def test_unknown_service_exits_1(capsys) -> None:
    codes = asyncio.run(_serve({"": Status.SERVING},
                               [["--address", "{addr}", "--service", "no.such.Service"]]))
    assert codes == [1]
    assert "NOT_FOUND" in capsys.readouterr().out


def test_unreachable_exits_1_within_the_timeout(capsys) -> None:
    port = free_port()  # nothing listens there any more
    assert _tandem_health(["--address", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert "UNAVAILABLE" in out or "DEADLINE_EXCEEDED" in out


def test_check_returns_a_typed_result() -> None:
    async def probe() -> tuple[healthcheck.HealthResult, healthcheck.HealthResult]:
        async with health_server() as (address, servicer):
            await servicer.set(WORKER, Status.NOT_SERVING)
            serving = await asyncio.to_thread(healthcheck.check, address)
            worker = await asyncio.to_thread(healthcheck.check, address, WORKER)
            return serving, worker

    serving, worker = asyncio.run(probe())
    # grpc's HealthServicer reports the whole server ("") SERVING until told otherwise.
    assert serving == healthcheck.HealthResult("SERVING") and serving.serving
    assert worker == healthcheck.HealthResult("NOT_SERVING") and not worker.serving


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_timeout_must_be_positive(timeout: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        healthcheck.main(["--address", "127.0.0.1:1", "--timeout", timeout])
    assert e.value.code == 2 and "--timeout" in capsys.readouterr().err


def test_cluster_flags_go_together_and_an_unreadable_file_is_an_error(tmp_path, capsys) -> None:
    """A probe that lost one of its flags says which, exit 2, instead of grpc aborting it."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not read")
    assert healthcheck.main(["--address", "127.0.0.1:1", "--cluster-ca", str(ca),
                             "--cluster-cert", str(ca)]) == 2
    assert "--cluster-key missing" in capsys.readouterr().err
    assert healthcheck.main(["--address", "127.0.0.1:1", "--cluster-ca", str(tmp_path / "no"),
                             "--cluster-cert", str(ca), "--cluster-key", str(ca)]) == 2
    assert "No such file" in capsys.readouterr().err
