"""Prefill and decode as two hosts would run them: each in a network namespace of its own,
joined by a veth pair (10.77.0.1 <-> 10.77.0.2), KV pages over NIXL with UCX on TCP over that
link (UCX_TLS=tcp, UCX_NET_DEVICES = each side's veth end), gRPC between the router (beside the
decode worker) and the prefill worker across the link too. Outputs equal the offline engine's,
and both pools end idle.

Needs root (network namespaces), iproute2 and util-linux (unshare, nsenter); skipped otherwise,
saying which. Nothing touches the machine's own network namespace: both namespaces and the veth
pair are made here and vanish with the two holder processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(4 + 9 * i)] for i in range(6)]
WORKER_ARGS = ["--device", "cpu", "--num-blocks", "128", "--max-num-batched-tokens", "64",
               "--cpu-threads", "1"]
P_ADDR, D_ADDR = "10.77.0.1", "10.77.0.2"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        return f"the nixl package is not installed (pip install 'tandem[nixl]'): {e}"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


class Host:
    """A network namespace held open by a process of its own (it ends when its stdin closes)."""

    def __init__(self) -> None:
        # The holder says "up" from inside its new namespace: until then its pid is still in
        # the machine's own, where nsenter would have put the veth pair (a busy run did).
        self.holder = subprocess.Popen(["unshare", "--net", "sh", "-c", "echo up && exec cat"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.holder.stdout.readline() == b"up\n", "the namespace's holder did not start"
        self.procs: list[subprocess.Popen] = []

    def run(self, *cmd: str) -> None:
        subprocess.run(["nsenter", "-t", str(self.holder.pid), "-n", *cmd], check=True)

    def enter(self, argv: list[str]) -> list[str]:
        """argv run in this namespace, with a private mount namespace whose /sys shows this
        namespace's network devices (UCX looks its devices up there)."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "unshare", "--mount",
                "--propagation", "private", "sh", "-c", 'mount -t sysfs sysfs /sys && exec "$@"',
                "sh", *argv]

    def spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        with open(log, "w") as f:
            p = subprocess.Popen(self.enter(argv),
                                 stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                 cwd=REPO)
        self.procs.append(p)
        return p

    def close(self) -> list[int | None]:
        codes = []
        for p in reversed(self.procs):  # the router before the decode worker it streams from
            if p.poll() is None:
                p.terminate()
            try:
                codes.append(p.wait(60))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        self.holder.stdin.close()
        self.holder.wait()
        self.holder.stdout.close()
        return codes


def _tandem(*args: str, ready: Path) -> list[str]:
    return [sys.executable, "-m", "tandem.cli.main", *args, "--ready-file", str(ready)]


def _wait_ready(proc: subprocess.Popen, ready: Path, log: Path) -> None:
    """Until the process writes its ready file, or fails if it exits first."""
    import time

    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"{log.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time
    import grpc
    from tandem.engine.sampling_params import SamplingParams
    from tandem.runtime.convert import params_to_proto
    from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc
    router, workers, prompts = sys.argv[1], sys.argv[2].split(","), json.loads(sys.argv[3])

    async def generate(stub, prompt):
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt), params=
                                      params_to_proto(SamplingParams(temperature=0, max_tokens=12)))
        out = []
        async for chunk in stub.Generate(req, timeout=120):
            out.extend(chunk.token_ids)
        return out

    async def idle(address):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            deadline = time.monotonic() + 30
            while True:
                load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                if (load.num_running, load.num_waiting, load.num_leases,
                        load.num_blocks - load.num_free_blocks) == (0, 0, 0, 0):
                    return True
                if time.monotonic() > deadline:
                    return str(load)
                await asyncio.sleep(0.05)

    async def main():
        async with grpc.aio.insecure_channel(router) as ch:
            stub = api_pb2_grpc.TandemStub(ch)
            tokens = await asyncio.gather(*(generate(stub, p) for p in prompts))
        return {"tokens": tokens, "idle": [await idle(w) for w in workers]}

    print(json.dumps(asyncio.run(main())))
""")


def test_prefill_and_decode_in_two_network_namespaces_over_nixl_tcp(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    expected = [o.outputs[0].token_ids for o in LLM(model, progress=False, num_blocks=128)
                .generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    p_host, d_host = Host(), Host()
    try:
        # The "wire": a veth pair, one end in each namespace (made in P's, its peer moved to
        # D's by the holder's pid: never the machine's own namespace).
        p_host.run("ip", "link", "add", "vP", "type", "veth", "peer", "name", "vD", "netns",
                   str(d_host.holder.pid))
        for host, dev, addr in ((p_host, "vP", P_ADDR), (d_host, "vD", D_ADDR)):
            host.run("ip", "link", "set", "lo", "up")
            host.run("ip", "addr", "add", f"{addr}/30", "dev", dev)
            host.run("ip", "link", "set", dev, "up")
        env = {"TANDEM_LOG_FORMAT": "json", "UCX_TLS": "tcp", "PYTHONUNBUFFERED": "1"}
        ready = {n: tmp_path / f"{n}.ready" for n in ("prefill", "decode", "router")}
        logs = {n: tmp_path / f"{n}.log" for n in ready}
        # Plaintext between the namespaces: --insecure on both workers (the prefill worker
        # listens beyond loopback, the decode worker takes KV from another host).
        prefill = p_host.spawn(_tandem("prefill", "--model", model, "--host", P_ADDR, "--port",
                                       "50061", "--transport", "nixl", "--insecure", *WORKER_ARGS,
                                       ready=ready["prefill"]),
                               logs["prefill"], {**env, "UCX_NET_DEVICES": "vP"})
        decode = d_host.spawn(_tandem("decode", "--model", model, "--host", "127.0.0.1",
                                      "--port", "50062", "--insecure", *WORKER_ARGS,
                                      ready=ready["decode"]),
                              logs["decode"], {**env, "UCX_NET_DEVICES": "vD"})
        _wait_ready(prefill, ready["prefill"], logs["prefill"])
        _wait_ready(decode, ready["decode"], logs["decode"])
        router = d_host.spawn(_tandem("router", "--model", model, "--prefill",
                                      f"{P_ADDR}:50061", "--decode", "127.0.0.1:50062",
                                      "--grpc-port", "50051", "--http-port", "-1",
                                      ready=ready["router"]), logs["router"], env)
        _wait_ready(router, ready["router"], logs["router"])

        client = subprocess.run(
            d_host.enter([sys.executable, "-c", CLIENT, "127.0.0.1:50051",
                          f"{P_ADDR}:50061,127.0.0.1:50062", json.dumps(PROMPTS)]),
            capture_output=True, text=True, cwd=REPO, timeout=300)
        assert client.returncode == 0, client.stderr[-3000:]
        result = json.loads(client.stdout.strip().splitlines()[-1])
        assert result["tokens"] == expected
        assert result["idle"] == [True, True]
        # The KV crossed the link over NIXL: the decode worker mapped a nixl pool.
        mapped = [json.loads(line)["event"] for line in logs["decode"].read_text().splitlines()
                  if line.startswith("{") and "mapped the KV pool" in line]
        assert mapped and "'transport': 'nixl'" in mapped[0]
    finally:
        codes = d_host.close() + p_host.close()
    assert codes == [0, 0, 0], [log.read_text()[-2000:] for log in logs.values()]
