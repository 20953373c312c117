"""Shared test setup. Triton kernels run under the interpreter when no GPU is present; the
variable must be set before any kernel module is imported. Hypothesis tests have no per-example
deadline: the suite runs beside other CPU-bound work, where an example's time says nothing."""

from __future__ import annotations

import os
import secrets

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest
from hypothesis import settings

settings.register_profile("tandem", deadline=None)
settings.load_profile("tandem")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """name -> directory of a tiny random checkpoint of each supported architecture."""
    from tiny import ARCHS, build_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny(name, root / name) for name in ARCHS}


@pytest.fixture
def seed() -> int:
    """A fresh torch seed per test (tests print it in their failure messages); set
    TANDEM_TEST_SEED to replay one."""
    value = int(os.environ.get("TANDEM_TEST_SEED") or secrets.randbits(31))
    torch.manual_seed(value)
    return value
