"""A throwaway cluster CA: `tandem up` makes one per stack, and `tandem certs` writes one for a
deployment (docker-compose runs it as a one-shot service before the others start).

    <dir>/ca.pem               the cluster CA's certificate (every process trusts it, and only it)
    <dir>/<name>.pem, .key     a certificate the CA signed for one member of the cluster, for
                               server and client authentication; by default one per role:
                               router, prefill, decode, both

Each member's certificate names its role twice (runtime/cluster_roles.py): as its identity, the
URI spiffe://tandem/<role>/<name>, which workers check on every call, and as the DNS name
<role>.tandem.internal, which callers check in the handshake; and it carries loopback and the
given host names, for tools that dial a host (`tandem health`). A process holds its own role's
key only: a decode worker's key cannot answer as a prefill worker nor call as the router.

The CA's private key is never written: once the certificates are signed it is dropped, so
nothing can sign another certificate this cluster would accept. Every file is written anew
(write_fresh): the keys mode 0600, whatever --out held before.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument
from tandem.runtime.cluster_roles import ROLES, peer_name, spiffe_id
from tandem.runtime.security import ClusterTls

LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ClusterCerts:
    """What make_cluster_ca wrote: the CA's certificate and each member's (name -> role)."""

    dir: Path
    members: Mapping[str, str]

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def tls(self, name: str) -> ClusterTls:
        """Member `name`'s certificate and key, with the CA: its --cluster-* flags."""
        if name not in self.members:
            raise KeyError(f"no certificate for {name!r} (members: {', '.join(self.members)})")
        return ClusterTls(self.ca, self.dir / f"{name}.pem", self.dir / f"{name}.key")


def _san(host: str):
    from cryptography import x509  # noqa: PLC0415

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_cluster_ca(out_dir: Path | str, hosts: Sequence[str] = (), days: int = 30,
                    members: Mapping[str, str] | None = None) -> ClusterCerts:
    """Write ca.pem and, for each member (name -> role; default: each role under its own
    name), <name>.pem and <name>.key (P-256 keys) under out_dir."""
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: PLC0415

    members = dict(members) if members is not None else {role: role for role in ROLES}
    for name, role in members.items():
        if role not in ROLES or not name or "/" in name or name == "ca":
            raise InvalidArgument("members", f"{name!r}: a name (not 'ca', no '/') and one of "
                                  f"{', '.join(ROLES)}, got role {role!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    write_fresh(out / "ca.pem", ca.public_bytes(pem), 0o644)

    hosts = list(dict.fromkeys([*LOOPBACK, *(h for h in hosts if h)]))
    for name, role in members.items():
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.UniformResourceIdentifier(spiffe_id(role, name)),
                x509.DNSName(peer_name(role)), *(_san(h) for h in hosts)]
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                            f"tandem {role} {name}")]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        write_fresh(out / f"{name}.pem", cert.public_bytes(pem), 0o644)
        write_fresh(out / f"{name}.key", key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), 0o600)
    return ClusterCerts(out, members)


def write_fresh(path: Path, data: bytes, mode: int) -> None:
    """`data` at `path` in a new file of `mode`: written to a temporary file the call itself
    creates in the same folder (O_EXCL, O_NOFOLLOW: never an existing file, never through a
    link), then renamed over `path`. Whatever was at `path` (a key left readable by others, a
    symbolic link to elsewhere) is replaced, never written into."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="write a throwaway cluster CA and a certificate per role")
    p.add_argument("--out", required=True,
                   help="directory for ca.pem and <role>.pem, <role>.key for each role")
    p.add_argument("--hosts", default="",
                   help="comma-separated host names the services are reached by, added to "
                        "every certificate (loopback is always included), e.g. "
                        "router,prefill,decode")
    p.add_argument("--days", type=int, default=30, help="validity in days")
    p.add_argument("--keep", action="store_true",
                   help="leave certificates already in --out as they are")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    files = ["ca.pem", *(f"{role}.{ext}" for role in ROLES for ext in ("pem", "key"))]
    if args.keep and all((out / f).exists() for f in files):
        print(f"tandem certs: keeping the certificates in {out}")
        return 0
    make_cluster_ca(out, [h.strip() for h in args.hosts.split(",")], args.days)
    print(f"tandem certs: wrote {', '.join(files)} to {out}")
    return 0
