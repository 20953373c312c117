"""Tandem's public Python package: errors, the generated gRPC stubs (tandem.v1) and the client
(tandem.client)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tandem")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
