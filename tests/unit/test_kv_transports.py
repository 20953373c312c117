"""The KV transport registry (kvtransfer/transports.py) is the one list: it holds exactly the
transports Tandem has, each one module of kvtransfer/ with its TRANSPORT, importable without a
GPU; the CLI's --transport choices and default, the descriptor's checks and tensor
parallelism's transports all come from it (a transport registered in a test shows up in each),
and no other source file spells the list out."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from tandem.errors import InvalidArgument
from tandem.kvtransfer import transports

REPO = Path(__file__).resolve().parents[2]


def test_the_registry_lists_exactly_the_transports():
    assert transports.names() == ("shm", "cuda_ipc", "nixl", "tcp")
    assert transports.tensor_transports() == ("shm", "cuda_ipc")
    assert (transports.default_for("cpu"), transports.default_for("cuda:1")) == ("shm",
                                                                                "cuda_ipc")
    for name in transports.names():
        module = transports.entry(name).module
        assert importlib.util.find_spec(module) is not None, module
        transport = transports.load(name)  # no GPU, no cupy here: imports must stay lazy
        assert transport.name == name
        for method in ("allocate", "open", "pull", "puller"):
            assert callable(getattr(transport, method)), (name, method)
    with pytest.raises(InvalidArgument, match=r"^transport: must be one of shm, cuda_ipc, nixl, tcp"):
        transports.entry("rdma")


def _transport_action(command: str) -> argparse.Action:
    from tandem.cli.main import build_parser

    sub = next(a for a in build_parser(command)._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]._option_string_actions["--transport"]


@pytest.fixture
def extra_transport(monkeypatch):
    """A transport registered for this test only (what its one registration line does)."""
    registry = dict(transports._REGISTRY)
    monkeypatch.setattr(transports, "_REGISTRY", registry)
    transports.register(transports.TransportEntry("tcp_test", "tandem.kvtransfer.shm", ("cpu",),
                                                  "a test's", maps_tensors=True))
    return "tcp_test"


@pytest.mark.parametrize("command", ["prefill", "worker"])
def test_cli_choices_come_from_the_registry(command, extra_transport):
    action = _transport_action(command)
    assert tuple(action.choices) == transports.names() == ("shm", "cuda_ipc", "nixl", "tcp",
                                                           extra_transport)
    assert "tcp_test: a test's" in action.help and "default: shm on cpu" in action.help


def test_descriptor_and_tensor_parallelism_take_the_registry(extra_transport):
    from tandem.kvtransfer.descriptor import PoolDescriptor

    layout = dict(dtype="float16", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                  num_blocks=4, owner_pid=1)
    PoolDescriptor(transport=extra_transport, handle=b"x", device_index=-1, **layout)
    with pytest.raises(InvalidArgument, match=r"^device_index: a tcp_test pool is on the CPU"):
        PoolDescriptor(transport=extra_transport, handle=b"x", device_index=0, **layout)
    assert extra_transport in transports.tensor_transports()


def test_no_other_source_file_lists_the_transports():
    """A list of transport names outside the registry is a copy that would drift."""
    listed = re.compile(r"""["'](shm|cuda_ipc|nixl)["']\s*,\s*["'](shm|cuda_ipc|nixl)["']""")
    found = []
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("tests", "build") or rel.parts[0].startswith(".") \
                or rel == Path("kvtransfer/transports.py"):
            continue
        if listed.search(path.read_text()):
            found.append(str(rel))
    assert found == []
