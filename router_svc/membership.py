"""Workers the router learns while it runs, besides the fixed --prefill/--decode/--workers.

Sources, re-read every `interval_s`:
- a file (`--workers-file`): one worker a line, `ROLE HOST:PORT` (role prefill, decode or both);
  blank lines and `#` comments are skipped. Rewrite it (atomically: write, then rename) to add
  or remove workers.
- DNS (`--prefill-dns NAME:PORT`, `--decode-dns NAME:PORT`): every address NAME resolves to is a
  worker at that port. On Kubernetes NAME is a headless Service: one record per ready pod, so
  scaling a Deployment adds and removes workers.

The router adds a worker that appears and drains one that disappears (no new requests; the ones
in flight finish; then its channel closes): WorkerSet.set_members. A source that cannot be read
this time (file missing, DNS failing) leaves the members as they were, and says so once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
Members = dict[str, set[str]]  # role -> addresses
Resolver = Callable[[str, int], Awaitable[list[str]]]


def parse_workers_file(text: str) -> Members:
    """`ROLE HOST:PORT` lines into role -> addresses; errors name the line."""
    members: Members = {role: set() for role in ROLES}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in ROLES:
            raise InvalidArgument("--workers-file", f"line {n}: expected 'ROLE HOST:PORT' with "
                                                    f"ROLE one of {', '.join(ROLES)}, got {raw!r}")
        members[parts[0]].add(_check_address(parts[1], f"--workers-file line {n}"))
    return members


def _check_address(address: str, field: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(field, f"expected HOST:PORT, got {address!r}")
    return address


def parse_dns_target(value: str, flag: str) -> tuple[str, int]:
    name, port = _check_address(value, flag).rsplit(":", 1)
    return name, int(port)


async def resolve(name: str, port: int) -> list[str]:
    """Every address `name` resolves to, as HOST:PORT (IPv6 in brackets), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    out = set()
    for family, _, _, _, sockaddr in infos:
        host = sockaddr[0]
        out.add(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
    return sorted(out)


@dataclass(frozen=True)
class MembershipConfig:
    workers_file: Path | None = None
    dns: tuple[tuple[str, str, int], ...] = ()  # (role, name, port)
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise InvalidArgument("--membership-interval", "must be > 0")

    @property
    def enabled(self) -> bool:
        return self.workers_file is not None or bool(self.dns)


class Membership:
    """Reads the sources and hands WorkerSet the members, once (`refresh`) or every interval
    (`start` ... `close`)."""

    def __init__(self, config: MembershipConfig, apply: Callable[[Members], None],
                 resolver: Resolver = resolve) -> None:
        self.config = config
        self.apply = apply
        self.resolver = resolver
        self._task: asyncio.Task | None = None
        self._failing: set[str] = set()  # sources whose failure was logged, until they recover

    async def read(self) -> Members | None:
        """The members now, or None when a source cannot be read (keep the last ones)."""
        members: Members = {role: set() for role in ROLES}
        ok = True
        if self.config.workers_file is not None:
            source = str(self.config.workers_file)
            try:
                found = parse_workers_file(self.config.workers_file.read_text())
            except (OSError, InvalidArgument) as e:
                ok = self._failed(source, e)
            else:
                self._recovered(source)
                for role, addrs in found.items():
                    members[role] |= addrs
        for role, name, port in self.config.dns:
            source = f"{name}:{port}"
            try:
                members[role] |= set(await self.resolver(name, port))
            except OSError as e:
                ok = self._failed(source, e)
            else:
                self._recovered(source)
        return members if ok else None

    def _failed(self, source: str, e: Exception) -> bool:
        if source not in self._failing:
            self._failing.add(source)
            log.warning("cannot read the workers from %s (%s): keeping the ones known", source, e)
        return False

    def _recovered(self, source: str) -> None:
        if source in self._failing:
            self._failing.discard(source)
            log.info("reading the workers from %s again", source)

    async def refresh(self) -> None:
        members = await self.read()
        if members is not None:
            self.apply(members)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.refresh()
            except Exception:  # a bug here must not end membership updates for good
                log.exception("updating the workers failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def config_from_args(workers_file: str | None, prefill_dns: Sequence[str] | None,
                     decode_dns: Sequence[str] | None, interval_s: float) -> MembershipConfig:
    dns = []
    for role, flag, values in (("prefill", "--prefill-dns", prefill_dns),
                               ("decode", "--decode-dns", decode_dns)):
        for v in values or ():
            dns.append((role, *parse_dns_target(v, flag)))
    return MembershipConfig(Path(workers_file) if workers_file else None, tuple(dns), interval_s)
