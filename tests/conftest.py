"""Shared test setup. Triton kernels run under the interpreter when no GPU is present; the
variable must be set before any kernel module is imported. Hypothesis tests have no per-example
deadline: the suite runs beside other CPU-bound work, where an example's time says nothing.

One torch thread in this process and every process it starts (OMP_NUM_THREADS, which the
launcher's workers take too): the tiny models' steps are too small to split across cores, and
a second thread spinning between them tripled a test's CPU time. The cores go to the suite's
parallel runners instead (pytest-xdist, `make test`), each picking ports from a range of its
own (TANDEM_PORT_RANGE, cli/launcher.py)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _port_range() -> str | None:
    """This runner's share of the launcher's port range (TANDEM_PORT_RANGE's where set), under
    pytest-xdist; None where the range is too small to share."""
    from tandem.cli.launcher import port_range

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    low, high = port_range()
    size = (high - low + 1) // max(count, 1)
    if not (worker.startswith("gw") and count and size >= 100):
        return None
    start = low + int(worker[2:]) * size
    return f"{start}-{start + size - 1}"


if (_ports := _port_range()) is not None:
    from tandem.cli.launcher import PORT_RANGE_ENV

    os.environ[PORT_RANGE_ENV] = _ports

import torch  # noqa: E402  (after OMP_NUM_THREADS)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("tandem", deadline=None)
settings.load_profile("tandem")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """name -> directory of a tiny random checkpoint of each supported architecture."""
    from tiny import ARCHS, build_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {name: build_tiny(name, root / name) for name in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama_long(tiny_models, tmp_path_factory) -> Path:
    """The tiny llama with a 32K-token context: a request there can generate for minutes on the
    CPU, so a test holds a worker's slot with one until it cancels it (no race with its end)."""
    from tiny import with_context

    return with_context(tiny_models["llama"], tmp_path_factory.mktemp("long") / "llama", 32768)


@pytest.fixture(scope="session")
def tiny_qwen2_long(tiny_models, tmp_path_factory) -> Path:
    """The tiny qwen2 with a 32K-token context, as tiny_llama_long (tensor-parallel stacks)."""
    from tiny import with_context

    return with_context(tiny_models["qwen2"], tmp_path_factory.mktemp("long") / "qwen2", 32768)


@pytest.fixture
def seed() -> int:
    """A fresh torch seed per test (tests print it in their failure messages); set
    TANDEM_TEST_SEED to replay one."""
    value = int(os.environ.get("TANDEM_TEST_SEED") or secrets.randbits(31))
    torch.manual_seed(value)
    return value
