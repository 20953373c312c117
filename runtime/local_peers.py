"""Which process answers at an address on this machine: the one identity a cluster without TLS
has. Without certificates, whoever answers at an address a lease names could present any
worker's pool descriptor as its own (fetched from that worker) and answer claims for it with
block ids of its choosing. On one machine the kernel knows better: a pool descriptor names its
owner (`owner_pid`, a worker's engine core), and the worker's gRPC server is that process's
parent. A decode worker without cluster TLS maps a peer's pool only when one of the two listens
at the very address it dialed.

This sees processes of the same user (or all, as root): a worker of another user is refused,
which is right, since nothing else vouches for it. Peers on other machines cannot be checked
at all: without TLS a decode worker takes KV from them only when told --insecure.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

WILDCARDS = ("0.0.0.0", "::")


def split_address(address: str) -> tuple[str, int]:
    """host and port of host:port ([v6]:port too); ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


def loopback_ips(host: str) -> set[str] | None:
    """The loopback addresses `host` stands for; None when it is not this machine's loopback
    ('localhost' is resolved; no other name is taken for loopback)."""
    if host == "localhost":
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        ips = {str(info[4][0]) for info in infos}
        return ips if ips and all(ipaddress.ip_address(ip).is_loopback for ip in ips) else None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return {str(ip)} if ip.is_loopback else None


def pool_owner_listens(owner_pid: int, address: str) -> bool:
    """Whether the process `owner_pid` (a pool's owner) or its parent listens at `address`, a
    loopback host:port. False when either cannot be looked at (gone, another user's)."""
    host, port = split_address(address)
    ips = loopback_ips(host)
    if ips is None:
        return False
    try:
        owner = psutil.Process(owner_pid)
        for proc in (owner, owner.parent()):
            if proc is None:
                continue
            for conn in proc.net_connections(kind="tcp"):
                if (conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
                        and _unmapped(conn.laddr.ip) in {*ips, *WILDCARDS}):
                    return True
    except psutil.Error:
        return False
    return False


def _unmapped(ip: str) -> str:
    """An IPv4 address as such, also when a dual-stack socket shows it IPv4-mapped
    (::ffff:127.0.0.1, as gRPC's listeners do)."""
    try:
        mapped = ipaddress.ip_address(ip.split("%", 1)[0]).ipv4_mapped  # type: ignore[union-attr]
    except (ValueError, AttributeError):
        return ip
    return str(mapped) if mapped is not None else ip
