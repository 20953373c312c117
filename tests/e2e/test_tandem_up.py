"""`tandem up` as a newcomer meets it: the banner names the model to send, counts its workers,
gives each worker's device and metrics address (and why it is on the CPU when --device auto fell
back), the model answers to its short name and to its path, and Ctrl-C stops everything."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.v1 import api_pb2, api_pb2_grpc

STARTUP_S = 120


@contextlib.contextmanager
def tandem_up(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `tandem up ARGS` on free ports; yield its banner once printed; Ctrl-C it at the end
    and insist that it exits 0."""
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "tandem.cli.main", "up", "--http-port", "0",
                               "--grpc-port", "0", "--num-blocks", "128", *args],
                              stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            deadline = time.monotonic() + STARTUP_S
            while (m := re.search(r"^Tandem is up.*?^Ctrl-C stops everything\.$",
                                  log_path.read_text(), re.M | re.S)) is None:
                assert up.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
            yield m.group(0)
        finally:
            up.send_signal(signal.SIGINT)
            code = up.wait(60)
    assert code == 0, log_path.read_text()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def complete(base: str, model: str, key: str | None = None) -> dict:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"{base}/completions", body, headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def metric_names(url: str) -> dict[str, set[str]]:
    """Family name -> the role labels of its samples."""
    return {f.name: {s.labels.get("role", "") for s in f.samples}
            for f in text_string_to_metric_families(get(url))}


def test_disaggregated_banner_names_metrics_and_dtype(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    # --gpus 0 lists one GPU for two workers: --device auto falls back to the CPU, and says so.
    with tandem_up(tmp_path, "--model", model, "--gpus", "0") as banner:
        assert banner.startswith('Tandem is up: model "llama", 2 workers.'), banner
        assert "Note: --device auto found 1 GPU for 2 workers" in banner, banner
        # A throwaway cluster CA: router and workers talk mutual TLS (tests/integration/
        # test_trust.py shows a worker refusing callers without its certificate); its files
        # never go to disk (tests/e2e/test_up_lifecycle.py).
        assert "  Internal:    mutual TLS, a throwaway cluster CA held in memory" in banner
        assert "API key:     none" in banner, banner
        workers = dict(re.findall(r"^  (prefill0|decode0): +cpu, metrics (\S+)$", banner, re.M))
        assert set(workers) == {"prefill0", "decode0"}, banner
        base = re.search(r"OpenAI HTTP: (\S+)", banner).group(1)
        grpc_address = re.search(r"gRPC: +(\S+)", banner).group(1)

        models = json.loads(get(f"{base}/models"))
        assert [m["id"] for m in models["data"]] == ["llama"]
        for name in ("llama", model):  # the short name and the path both reach it
            assert complete(base, name)["model"] == "llama"

        # Each worker's metrics are reachable, with its engine's KV-cache gauge; the router has
        # no KV cache and exports no such gauge.
        for name, url in workers.items():
            roles = metric_names(url).get("tandem:kv_cache_usage_perc")
            assert roles == {name.rstrip("0")}, (name, roles)
        router = metric_names(base.removesuffix("/v1") + "/metrics")
        assert "tandem:kv_cache_usage_perc" not in router
        assert router["tandem:time_to_first_token_seconds"] == {"router"}

        # The dtype the workers run (float32 on the CPU), not a default of the router's.
        with grpc.insecure_channel(grpc_address) as ch:
            info = api_pb2_grpc.TandemStub(ch).GetModelInfo(
                api_pb2.GetModelInfoRequest(model="llama"), timeout=10)
        assert (info.id, info.dtype) == ("llama", "float32")


def test_one_colocated_worker_with_a_served_name(tiny_models, tmp_path):
    """Also: an API key from the environment guards the stack and reaches no command line."""
    model = str(tiny_models["llama"])
    key = "up-key-" + "7" * 24
    with tandem_up(tmp_path, "--model", model, "--served-model-name", "tiny", "--device", "cpu",
                   "--prefill-workers", "0", "--decode-workers", "0", "--both-workers", "1",
                   "--metrics-port-base", "-1", env={"TANDEM_API_KEY": key}) as banner:
        assert banner.startswith('Tandem is up: model "tiny", 1 worker.'), banner
        assert re.search(r"^  both0: +cpu$", banner, re.M), banner  # no metrics port: -1
        assert "Note:" not in banner  # the CPU was asked for
        base = re.search(r"OpenAI HTTP: (\S+)", banner).group(1)
        assert "API key:     required" in banner, banner
        with pytest.raises(urllib.error.HTTPError) as e:
            complete(base, model)
        assert e.value.code == 401
        assert complete(base, model, key)["model"] == "tiny"
        assert not any(key.encode() in _cmdline(p) for p in Path("/proc").glob("[0-9]*"))


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # a process that ended meanwhile
        return b""
