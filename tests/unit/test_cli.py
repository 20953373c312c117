"""What the `tandem` command promises before any service runs: bad arguments exit 2 naming the
flag, `generate` and the workers share their engine defaults, a checkpoint is served under its
own name, and `tandem up --device auto` says when it falls back to the CPU."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys

import pytest

from tandem.cli.main import build_parser
from tandem.cli.up import _devices
from tandem.engine.config import EngineConfig
from tandem.engine.model_source import served_name
from tandem.errors import InvalidArgument
from tandem.router_svc.server import model_names
from tandem.runtime.engine_args import engine_config

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
    res = subprocess.run([sys.executable, "-m", "tandem.cli.main", *argv], capture_output=True,
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


def test_tensor_parallel_workers_take_consecutive_gpus():
    assert _devices(_args("cuda", gpus="0,1,2"), 2, [2, 1]) == (["cuda:0", "cuda:2"], "")
    assert _devices(_args("cuda", gpus="4,5,6,7"), 2, [2, 2]) == (["cuda:4", "cuda:6"], "")
    with pytest.raises(InvalidArgument, match="consecutive"):
        _devices(_args("cuda", gpus="0,2,3"), 2, [2, 1])
    with pytest.raises(InvalidArgument, match="one GPU per rank"):
        _devices(_args("cuda", gpus="0,1"), 2, [2, 1])
    devices, note = _devices(_args(gpus="0,1"), 2, [2, 1])
    assert devices == ["cpu", "cpu"] and "3 ranks" in note


def test_up_passes_each_role_its_tensor_parallel_size(monkeypatch):
    from tandem.cli.up import stack_from_args

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    stack, _ = stack_from_args(build_parser("up").parse_args(
        ["up", "--device", "cpu", "--prefill-tensor-parallel-size", "2"]))
    assert stack.role_args == {"prefill": ["--tensor-parallel-size", "2"]}
    assert stack.cpu_threads == max(1, len(os.sched_getaffinity(0)) // 3)  # 3 engine processes
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the operator's count wins
    stack, _ = stack_from_args(build_parser("up").parse_args(["up", "--device", "cpu"]))
    assert stack.cpu_threads == 3
    stack, _ = stack_from_args(build_parser("up").parse_args(
        ["up", "--device", "cpu", "--tensor-parallel-size", "2", "--decode-tensor-parallel-size",
         "1", "--both-workers", "1"]))
    assert stack.role_args == {"prefill": ["--tensor-parallel-size", "2"],
                               "both": ["--tensor-parallel-size", "2"]}


def test_up_elastic_needs_split_workers_of_one_size_and_the_routers_planner():
    import pytest

    from tandem.cli.up import stack_from_args
    from tandem.errors import InvalidArgument

    planner = ["--router-arg=--planner-ttft=2", "--router-arg=--planner-itl=0.1"]

    def stack(*argv: str):
        return stack_from_args(build_parser("up").parse_args(
            ["up", "--device", "cpu", "--elastic", *argv]))[0]

    s = stack(*planner)
    assert s.elastic and s.workers_file is not None
    for argv, field, says in [
        ((), "--elastic", "--planner-ttft"),
        (("--router-arg=--planner-ttft=2",), "--elastic", "--planner-itl"),
        (("--prefill-workers", "0", "--decode-workers", "0", "--both-workers", "2", *planner),
         "--elastic", "colocated"),
        (("--prefill-tensor-parallel-size", "2", *planner), "--elastic", "tensor-parallel"),
        (("--elastic-windows", "0", *planner), "--elastic-windows", ">= 1"),
    ]:
        with pytest.raises(InvalidArgument, match=says) as e:
            stack(*argv)
        assert e.value.field == field


def test_worker_and_generate_take_the_tensor_parallel_size(capsys):
    from tandem.cli.main import main

    for cmd in ("worker", "prefill", "decode", "generate"):
        args = build_parser(cmd).parse_args([cmd, "--model", "m", "--tensor-parallel-size", "2"])
        assert engine_config(args).tensor_parallel_size == 2
    assert main(["generate", "--model", "tandem-demo", "--prompt-token-ids", "1,2",
                 "--tensor-parallel-size", "0"]) == 2
    assert "argument --tensor-parallel-size: must be >= 1" in capsys.readouterr().err


# -- the first minute: help, flag errors, ports -----------------------------------------------
HELP_AND_ERRORS = [(["--help"], 0), ([], 2), (["bogus"], 2), (["--bogus"], 2),
                   *(([name, "--help"], 0) for name in ("generate", "up", "router", "prefill",
                                                        "decode", "worker", "health", "certs")),
                   (["up", "--bogus"], 2), (["up", "--enforce-eager"], 2),
                   (["generate", "--bogus"], 2), (["router", "--bogus"], 2)]


def test_help_and_flag_errors_load_no_torch():
    """Parsing comes first: no subcommand's help or flag error waits for torch (it took
    `tandem --help` 19-24 s on a loaded machine)."""
    script = f"""
import sys
from tandem.cli.main import main
codes = []
for argv, _ in {HELP_AND_ERRORS!r}:
    try:
        main(argv)
    except SystemExit as e:
        codes.append(e.code)
print(codes, "torch" in sys.modules)
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[-2] == f"{[code for _, code in HELP_AND_ERRORS]} False", \
        res.stdout[-2000:]


def test_tandem_help_lists_each_subcommand_with_its_own_help():
    from tandem.cli.main import COMMANDS

    for name, (_, summary) in COMMANDS.items():
        listed = " ".join(build_parser(name).format_help().split())
        assert f"{name} {summary}" in listed, (name, listed)


def test_up_takes_vllms_spellings_and_a_positional_model():
    from tandem.cli.up import chosen_model, stack_from_args

    args = build_parser("up").parse_args(
        ["up", "my-model", "--port", "9000", "--gpu-memory-utilization", "0.5",
         "--max-model-len", "512", "--tensor-parallel-size", "2", "--ssl-certfile", "c.pem",
         "--ssl-keyfile", "k.pem", "--device", "cpu"])
    assert (args.http_port, args.tls_cert, args.tls_key) == (9000, "c.pem", "k.pem")
    assert chosen_model(args) == "my-model"
    stack, _ = stack_from_args(args)
    assert stack.model == "my-model"
    assert "--memory-fraction 0.5 --max-model-len 512" in " ".join(stack.worker_args) \
        or {"--memory-fraction", "0.5", "--max-model-len", "512"} <= set(stack.worker_args)
    assert stack.role_args["decode"] == ["--tensor-parallel-size", "2"]
    assert "--http-port 9000" in " ".join(stack.router_args)
    same = build_parser("up").parse_args(["up", "m", "--model", "m"])
    assert chosen_model(same) == "m"
    assert chosen_model(build_parser("up").parse_args(["up"])) == "smollm2-135m-instruct"
    # Workers and `generate` take vLLM's engine spellings too.
    for cmd in ("worker", "generate"):
        a = build_parser(cmd).parse_args([cmd, "--model", "m", "--gpu-memory-utilization",
                                          "0.7", "--enforce-eager", "--no-enable-prefix-caching"])
        cfg = engine_config(a)
        assert (cfg.memory_fraction, cfg.cuda_graphs, cfg.enable_prefix_caching) == \
            (0.7, False, False)


@pytest.mark.parametrize(("argv", "says"), [
    (["up", "a", "--model", "b"], "argument --model: two models given: 'a' and --model 'b'"),
    (["up", "--pipeline-parallel-size", "2"], "--tensor-parallel-size splits each worker"),
    (["up", "--enforce-eager"], "passes it on as --worker-arg=--enforce-eager"),
    (["up", "--no-reflection"], "passes it on as --router-arg=--no-reflection"),
    (["up", "--swap-space", "4"], "unrecognized arguments: --swap-space"),
])
def test_up_answers_other_spellings_with_tandems(argv, says, capsys):
    from tandem.cli.main import main

    try:
        code = main([*argv, "--http-port", "0", "--grpc-port", "0"])  # whatever else runs here
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert says in capsys.readouterr().err


def test_up_help_shows_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps at hyphens in narrower help
    with pytest.raises(SystemExit):
        build_parser("up").parse_args(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--http-port HTTP_PORT, --port HTTP_PORT OpenAI HTTP API (0: a free port) "
                  "(default: 8000)", "(default: 50051)", "--prefill-workers PREFILL_WORKERS "
                  "prefill workers (default: 1)", "(the workers' default: 0.9)", "(default: 30.0)",
                  "(default: smollm2-135m-instruct"):
        assert shown in text, shown


def test_built_in_model_names_are_case_insensitive(tmp_path):
    from tandem.engine.model_source import builtin_name, resolve_model

    assert served_name("SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert builtin_name("Tandem-Demo") == "tandem-demo"
    assert resolve_model("TANDEM-DEMO") == resolve_model("tandem-demo")
    # Requests may name it as --model spelt it.
    names = model_names(argparse.Namespace(model="SmolLM2-135M-Instruct", served_model_name=None))
    assert names == ("smollm2-135m-instruct", ("SmolLM2-135M-Instruct",))
    # A local path spelt like a built-in name is that path.
    (tmp_path / "Tandem-Demo").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert builtin_name("Tandem-Demo") is None
        assert served_name("Tandem-Demo") == "Tandem-Demo"


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_up_refuses_a_taken_port_before_loading_anything(flag, tmp_path):
    """Also a port held the way gRPC holds one (SO_REUSEPORT, which would let a second server
    share it). The model is one that cannot load: the port is checked first."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    try:
        res = subprocess.run([sys.executable, "-m", "tandem.cli.main", "up", "--model",
                              str(tmp_path / "no-such-model"), flag, str(port), other, "0",
                              "--log-dir", str(tmp_path / "logs")],
                             capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert res.returncode == 2, res.stderr
    assert f"argument {flag}: cannot listen on 127.0.0.1:{port}: in use" in res.stderr
    assert not (tmp_path / "logs").exists()  # no process was started


def test_a_grpc_server_cannot_share_a_port_in_use():
    """gRPC's default SO_REUSEPORT let a second `tandem up` listen on 50051 beside the first."""
    from tandem.runtime.lifecycle import make_server
    from tandem.runtime.security import bind

    async def main() -> None:
        first, second = make_server(), make_server()
        port = bind(first, "127.0.0.1", 0)
        await first.start()
        try:
            with pytest.raises((OSError, RuntimeError), match=r"cannot listen|Failed to bind"):
                bind(second, "127.0.0.1", port)
        finally:
            await first.stop(0)
            await second.stop(0)

    asyncio.run(main())


def test_a_leases_life_is_ten_times_its_ttl_unless_told_and_never_shorter():
    from tandem.prefill_svc.server import lease_life

    parse = build_parser("prefill").parse_args
    assert lease_life(parse(["prefill", "--model", "m"])) == (30.0, 300.0)
    assert lease_life(parse(["prefill", "--model", "m", "--lease-ttl", "5"])) == (5.0, 50.0)
    assert lease_life(parse(["prefill", "--model", "m", "--lease-max-life", "45"])) == (30.0, 45.0)
    for argv, flag in ((["--lease-max-life", "20"], "--lease-max-life"),
                       (["--lease-ttl", "0"], "--lease-ttl")):
        with pytest.raises(InvalidArgument) as e:
            lease_life(parse(["prefill", "--model", "m", *argv]))
        assert e.value.field == flag
    worker = build_parser("worker").parse_args(["worker", "--role", "prefill", "--model", "m",
                                                "--lease-max-life", "60"])
    assert lease_life(worker) == (30.0, 60.0)


def test_free_port_picks_from_the_range_it_is_given(monkeypatch):
    from tandem.cli import launcher

    monkeypatch.setenv(launcher.PORT_RANGE_ENV, "23000-23004")
    monkeypatch.setattr(launcher, "_handed_out", set())
    ports = {launcher.free_port() for _ in range(3)}
    assert len(ports) == 3 and ports <= set(range(23000, 23005))  # none handed out twice
    for bad in ("23000", "23005-23000", "80-90", "a-b"):
        monkeypatch.setenv(launcher.PORT_RANGE_ENV, bad)
        with pytest.raises(ValueError, match=launcher.PORT_RANGE_ENV):
            launcher.free_port()
