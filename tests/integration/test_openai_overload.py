"""The OpenAI-compatible HTTP API's answers when it cannot serve, against real processes on
127.0.0.1: 429 with Retry-After from a router at its --max-requests, an error event on a stream
whose only worker died, 503 once no worker is left; and the statuses for the errors no scenario
reaches."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from cluster import WORKER_ARGS, Cluster
from tandem.errors import InvalidArgument, Overloaded
from tandem.router_svc.http_errors import api_error
from tandem.router_svc.orchestrator import RouterError

LONG = 1000  # tokens: far longer than any test waits (~3 ms a token on a CPU)


def test_full_router_answers_429_and_503_without_workers(tiny_models, tmp_path):
    c = Cluster(tmp_path, str(tiny_models["llama"]), prefill=0, decode=0, both=1,
                worker_args=WORKER_ARGS, router_args=["--max-requests", "1"]).start()
    try:
        small = {"model": c.model, "prompt": "hi", "max_tokens": 2}
        with httpx.Client(base_url=f"http://127.0.0.1:{c.router.http_port}", timeout=30) as h:
            with h.stream("POST", "/v1/completions", json={
                    **small, "max_tokens": LONG - 10, "ignore_eos": True, "stream": True}) as long:
                lines = long.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                for path, extra in [("/v1/completions", {}), ("/v1/chat/completions", {
                        "messages": [{"role": "user", "content": "hi"}], "stream": True})]:
                    body = {**small, **extra}
                    if "messages" in body:  # chat takes no prompt
                        del body["prompt"]
                    r = h.post(path, json=body)
                    assert r.status_code == 429, r.text
                    assert int(r.headers["retry-after"]) >= 1
                    assert r.json()["error"]["code"] == "rate_limit_exceeded"
                assert h.get("/health").status_code == 200

                # The only worker dies mid-stream: the stream ends with an error event.
                c.kill("both0")
                data = [line[6:] for line in lines if line.startswith("data: ")]
                err = json.loads(data[-1])["error"]
                assert err["type"] == "service_unavailable" and err["code"] == "unavailable"
            deadline = time.monotonic() + 5
            while h.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "health still 200 without a worker"
                time.sleep(0.05)
            r = h.post("/v1/completions", json=small)
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    finally:
        codes = c.stop()
    assert codes["router"] == 0, codes


@pytest.mark.parametrize(("error", "status", "param"), [
    (InvalidArgument("logprobs", "must be in [0, 20]"), 400, "top_logprobs"),  # chat's name
    (Overloaded("full"), 429, None),
    (RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker"), 503, None),
    (RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"), 504, None),
    (RouterError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), 400, None),
])
def test_error_status_mapping(error, status, param):
    """The statuses no scenario reaches, here or in test_openai.py (HTTP requests carry no
    deadline)."""
    e = api_error(error, {"logprobs": "top_logprobs"})
    assert (e.status, e.param) == (status, param)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    if status == 429:
        assert int(e.headers["Retry-After"]) >= 1
