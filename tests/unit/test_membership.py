"""The router's learnt membership: the workers file's format, DNS names, a source that cannot be
read keeping the last members, and WorkerSet adding, draining and removing workers."""

from __future__ import annotations

import asyncio

import pytest

from tandem.errors import InvalidArgument
from tandem.router_svc.membership import (
    Membership,
    MembershipConfig,
    config_from_args,
    parse_workers_file,
)
from tandem.router_svc.workers import WorkerSet


def test_workers_file_lines_are_role_and_address_with_comments_and_blanks() -> None:
    members = parse_workers_file("# the pool\nprefill 10.0.0.1:50061\n\n"
                                 "decode 10.0.0.2:50062  # gpu box 2\ndecode [::1]:50062\n")
    assert members == {"prefill": {"10.0.0.1:50061"}, "decode": {"10.0.0.2:50062", "[::1]:50062"},
                       "both": set()}


@pytest.mark.parametrize("line", ["router 1.2.3.4:5", "decode", "decode 1.2.3.4",
                                  "decode 1.2.3.4:0", "decode host:port", "decode a:1 b:2"])
def test_a_bad_line_is_refused_naming_its_number(line: str) -> None:
    with pytest.raises(InvalidArgument, match="line 2") as e:
        parse_workers_file(f"prefill 10.0.0.1:1\n{line}\n")
    assert e.value.field.startswith("--workers-file")


def test_dns_flags_need_a_port_and_the_interval_must_be_positive() -> None:
    cfg = config_from_args(None, ["tandem-prefill:50061"], ["tandem-decode:50062"], 1.0)
    assert cfg.dns == (("prefill", "tandem-prefill", 50061), ("decode", "tandem-decode", 50062))
    with pytest.raises(InvalidArgument, match="--decode-dns"):
        config_from_args(None, None, ["tandem-decode"], 1.0)
    with pytest.raises(InvalidArgument, match="--membership-interval"):
        config_from_args("f", None, None, 0)


def test_members_come_from_the_file_and_dns_and_an_unreadable_source_keeps_the_last(
        tmp_path) -> None:
    path = tmp_path / "workers"
    path.write_text("prefill 10.0.0.1:50061\n")
    answers: dict[str, list[str] | OSError] = {"d": ["10.0.1.1:50062", "10.0.1.2:50062"]}

    async def resolver(name: str, port: int) -> list[str]:
        answer = answers[name]
        if isinstance(answer, OSError):
            raise answer
        return answer

    applied: list[dict] = []
    m = Membership(MembershipConfig(path, (("decode", "d", 50062),), 1.0), applied.append,
                   resolver)

    async def main() -> None:
        await m.refresh()
        answers["d"] = OSError("Temporary failure in name resolution")
        await m.refresh()  # nothing applied: the last members stay
        answers["d"] = ["10.0.1.2:50062"]
        path.unlink()
        await m.refresh()  # the file is gone: nothing applied either
        path.write_text("prefill 10.0.0.1:50061\nprefill 10.0.0.9:50061\n")
        await m.refresh()

    asyncio.run(main())
    assert applied == [
        {"prefill": {"10.0.0.1:50061"}, "decode": {"10.0.1.1:50062", "10.0.1.2:50062"},
         "both": set()},
        {"prefill": {"10.0.0.1:50061", "10.0.0.9:50061"}, "decode": {"10.0.1.2:50062"},
         "both": set()},
    ]


def test_a_router_that_knows_no_worker_yet_is_not_healthy() -> None:
    async def main() -> None:
        ws = WorkerSet([], [], [])
        assert not ws.all_healthy()
        ws.set_members({"decode": {"127.0.0.1:2"}})
        ws.workers[0].healthy = True
        assert ws.all_healthy()
        await ws.close()

    asyncio.run(main())


def test_decode_workers_alone_are_a_split_fleet_that_prefill_fallback_serves() -> None:
    """A fleet whose roles change may have no prefill worker for a while: its decode workers
    still take requests (prefilling them themselves), not the colocated path."""

    async def main() -> None:
        ws = WorkerSet([], [], [])
        ws.set_members({"decode": {"127.0.0.1:2"}})
        ws.workers[0].healthy = True
        assert ws.disaggregated and ws.ready()
        ws.prefill_fallback = False
        assert not ws.ready()
        await ws.close()

    asyncio.run(main())


def test_dns_names_resolve_to_every_address_at_the_port() -> None:
    from tandem.router_svc.membership import resolve

    addresses = asyncio.run(resolve("localhost", 50061))  # /etc/hosts: loopback only
    assert addresses and set(addresses) <= {"127.0.0.1:50061", "[::1]:50061"}


def test_workers_join_drain_come_back_and_are_removed_once_idle() -> None:
    """Addresses on loopback ports nothing listens on: no poll is made here."""

    async def main() -> None:
        ws = WorkerSet(["127.0.0.1:1"], [], [])  # given by flag: never drained
        ws.set_members({"prefill": set(), "decode": {"127.0.0.1:2", "127.0.0.1:3"}})
        by = {w.address: w for w in ws.workers}
        assert [w.address for w in ws.workers] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
        for w in ws.workers:
            w.healthy = True
        by["127.0.0.1:2"].in_flight = 1  # a stream still running there
        ws.set_members({"decode": {"127.0.0.1:3"}})  # :2 left
        assert by["127.0.0.1:2"].draining and not by["127.0.0.1:1"].draining
        assert [w.address for w in ws.by_role("decode")] == ["127.0.0.1:3"]
        assert ws.by_role("decode", healthy_only=False) == [by["127.0.0.1:3"]]
        by["127.0.0.1:2"].healthy = False
        assert ws.all_healthy()  # a draining worker does not make the router unhealthy
        for _ in range(3):
            await ws._remove_drained()
        assert by["127.0.0.1:2"] in ws.workers  # still in flight: kept
        by["127.0.0.1:2"].in_flight = 0
        await ws._remove_drained()
        assert by["127.0.0.1:2"] in ws.workers  # one idle round is not enough
        ws.set_members({"decode": {"127.0.0.1:3", "127.0.0.1:2"}})  # back before removal
        assert not by["127.0.0.1:2"].draining
        await ws._remove_drained()
        await ws._remove_drained()
        assert by["127.0.0.1:2"] in ws.workers
        ws.set_members({})
        await ws._remove_drained()
        await ws._remove_drained()
        assert [w.address for w in ws.workers] == ["127.0.0.1:1"]
        ws.workers[0].healthy = True
        assert ws.all_healthy()
        await ws.close()

    asyncio.run(main())
