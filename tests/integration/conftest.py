"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from traces import Receiver


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """An OTLP/gRPC trace receiver on 127.0.0.1 for the module's services, stopped at the end."""
    r = Receiver()
    yield r
    r.server.stop(0)
