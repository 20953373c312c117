"""Tandem: errors, the generated gRPC stubs (tandem.v1), the client (tandem.client), and the
services' packages, which live in the design card's folders at the repository root:
tandem.router_svc, tandem.prefill_svc, tandem.decode_svc, tandem.kvtransfer, tandem.kernels,
tandem.engine, tandem.runtime and tandem.cli. An installed wheel holds them under tandem/
(pyproject.toml's package-dir); run from a source tree, this package's path reaches them
where they are."""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

_root = Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "router_svc" / "__init__.py").is_file():
    __path__.append(str(_root))  # a source tree (a checkout, or an editable install of one)

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
