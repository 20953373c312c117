"""Tokenizer fixtures shared by the tokenizer and detokenizer tests."""

from __future__ import annotations

import pytest

from engine.demo import build_demo_checkpoint
from engine.tokenizer import Tokenizer
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
