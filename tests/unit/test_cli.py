"""What the `tandem` command promises before any service runs: bad arguments exit 2 naming the
flag, `generate` and the workers share their engine defaults, a checkpoint is served under its
own name, and `tandem up --device auto` says when it falls back to the CPU."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from cli.main import build_parser
from cli.up import _devices
from engine.config import EngineConfig
from engine.model_source import served_name
from router_svc.server import model_names
from runtime.engine_args import engine_config

BAD_ARGUMENTS = [
    (["router", "--model", "tandem-demo"], "--prefill"),
    (["router", "--model", "tandem-demo", "--prefill", "127.0.0.1:1"], "--decode"),
    (["router", "--model", "tandem-demo", "--decode", "127.0.0.1:1"], "--prefill"),
    (["up", "--prefill-workers", "0"], "--prefill-workers"),
    (["up", "--prefill-workers", "0", "--decode-workers", "0"], "--both-workers"),
    (["up", "--device", "cuda", "--gpus", "0"], "--gpus"),
    (["generate", "--model", "tandem-demo"], "--prompt"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD_ARGUMENTS)
def test_bad_arguments_exit_2_naming_the_flag(argv, flag):
    res = subprocess.run([sys.executable, "-m", "cli.main", *argv], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert f"argument {flag}:" in res.stderr, res.stderr


@pytest.mark.parametrize("command", ["generate", "worker", "prefill", "decode"])
def test_generate_and_workers_share_the_prefix_caching_default(command):
    parse = build_parser(command).parse_args
    base = [command, "--model", "m"]
    assert engine_config(parse(base)).enable_prefix_caching is True
    assert EngineConfig.enable_prefix_caching is True  # the engine's own default, the same
    assert engine_config(parse([*base, "--no-prefix-caching"])).enable_prefix_caching is False


def test_a_checkpoint_is_served_under_its_own_name(tmp_path):
    ckpt = tmp_path / "Llama-3.1-8B-Instruct"
    ckpt.mkdir()
    gguf = tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf"
    gguf.write_bytes(b"")
    assert served_name(f"{ckpt}/") == "Llama-3.1-8B-Instruct"
    assert served_name(str(gguf)) == "SmolLM2-135M-Instruct-Q8_0"
    assert served_name("tandem-demo") == "tandem-demo"
    assert served_name("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"  # a hub id

    def names(model: str, served: str | None = None):
        return model_names(argparse.Namespace(model=model, served_model_name=served))

    # Requests may also name it by --model as given and by its absolute path.
    full = str(ckpt.resolve())
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert names("./Llama-3.1-8B-Instruct") == ("Llama-3.1-8B-Instruct",
                                                    tuple(sorted({"./Llama-3.1-8B-Instruct", full})))
    assert names(full, "llama") == ("llama", (full,))
    assert names("tandem-demo") == ("tandem-demo", ())


def _args(device: str = "auto", gpus: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(device=device, gpus=gpus)


def test_auto_device_says_when_it_falls_back_to_the_cpu():
    devices, note = _devices(_args(gpus="3"), 2)
    assert devices == ["cpu", "cpu"]
    assert "found 1 GPU for 2 workers" in note and "CPU" in note
    assert _devices(_args(gpus="3"), 1) == (["cuda:3"], "")
    assert _devices(_args("cpu"), 1) == (["cpu"], "")  # asked for: nothing to explain
