"""Fixtures shared by unit tests: tokenizers (the tokenizer and detokenizer tests) and NIXL
endpoints (the nixl transport's tests)."""

from __future__ import annotations

import pytest

from tandem.engine.demo import build_demo_checkpoint
from tandem.engine.tokenizer import Tokenizer
from tiny_tokenizers import (
    MISTRAL_TEMPLATE,
    build_bytelevel_bpe_tokenizer,
    build_sentencepiece_tokenizer,
)


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("demo")
    build_demo_checkpoint(d)
    return Tokenizer(d)


@pytest.fixture(scope="session")
def sp(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"),
                                                   MISTRAL_TEMPLATE))


@pytest.fixture(scope="session")
def bpe(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_bytelevel_bpe_tokenizer(tmp_path_factory.mktemp("bpe")))


@pytest.fixture
def nixl_endpoints():
    """A maker of fresh NIXL endpoints (one agent each, as two processes would have), optionally
    with the agent wrapped (`agent_wrapper(agent)`); each is closed after the test."""
    from tandem.kvtransfer.nixl import NixlEndpoint

    made: list[NixlEndpoint] = []

    def make(agent_wrapper=None) -> NixlEndpoint:
        ep = NixlEndpoint()
        if agent_wrapper is not None:
            ep.agent = agent_wrapper(ep.agent)
        made.append(ep)
        return ep

    yield make
    for ep in reversed(made):  # readers before the owners they read from
        ep.close()
