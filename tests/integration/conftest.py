"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from traces import Receiver

from tandem.engine.llm import LLM


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """An OTLP/gRPC trace receiver on 127.0.0.1 for the module's services, stopped at the end."""
    r = Receiver()
    yield r
    r.server.stop(0)


@pytest.fixture(scope="module")
def offline(tiny_models) -> LLM:
    """The offline engine on the tiny llama (the reference a stack's greedy output must match)."""
    return LLM(str(tiny_models["llama"]), progress=False, num_blocks=256)
