"""Bounded property-based fuzzing of every worker RPC (tandem.v1.Worker, worker.proto) against a
live CPU stack on 127.0.0.1 (a prefill, a decode and a colocated worker): messages generated
from the proto's own descriptors (tests/proto_strategies.py: every field, the values that break
things mixed in), each sent to each worker. Whatever arrives, the answer is a status of the
caller's (never INTERNAL or UNKNOWN, a request update's included) within a generous bound (a
wedged worker would run into it); afterwards every worker answers at once and every pool is idle.

A decode request names only loopback addresses (the real prefill worker's among them): a worker
without cluster TLS dials nothing else anyway, and a test sends traffic to nothing else. Leases
that generated prefills (and lends of a cached prefix) granted are released at the end of each
test; a Stream call's requests are cancelled once sent, so that none generates up to the
model's length.
derandomize=True: the same examples on every run."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proto_strategies import messages

from cluster import Cluster
from tandem.runtime.cluster_roles import WORKER_CALLERS
from tandem.v1 import worker_pb2, worker_pb2_grpc

WORKER_ARGS = ["--num-blocks", "128", "--max-num-batched-tokens", "64"]
FUZZ = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
# A call that takes longer has wedged its worker (the slowest honest one, a prefill of a long
# prompt on a loaded two-core machine, takes well under a second).
GUARD_S = 30.0
# What a worker may answer a caller with: its own refusals, never an error of its own.
CALLER_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
METHODS = {m.name: m for m in SERVICE.methods}


class Stack:
    """The stack, one event loop for every call, a channel per worker, and the leases that
    generated prefills granted (released after each test)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.loop = asyncio.new_event_loop()
        self.workers = {p.name: p.address for p in cluster.workers()}
        self.stubs = self.run(self._connect())
        self.leases: list[str] = []
        self.codes: Counter = Counter()

    async def _connect(self):
        self.channels = {n: grpc.aio.insecure_channel(a) for n, a in self.workers.items()}
        return {n: worker_pb2_grpc.WorkerStub(ch) for n, ch in self.channels.items()}

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def call(self, worker: str, method: str, request) -> list[grpc.StatusCode]:
        """The call's status, and (Stream) each request update's."""
        rpc = getattr(self.stubs[worker], method)
        codes = []
        try:
            if method == "Stream":
                messages = request if hasattr(request, "__aiter__") else iter(request)
                async for msg in rpc(messages, timeout=GUARD_S):
                    codes += [_status(u.error_code) for u in msg.updates if u.done]
            elif method == "WatchKV":
                watch = rpc(request, timeout=GUARD_S)
                await watch.read()  # the whole set first: then it only follows changes
                watch.cancel()
            else:
                resp = await rpc(request, timeout=GUARD_S)
                if method in ("Prefill", "LendPrefix"):
                    self.leases.append((worker, resp.kv.lease_id))
        except grpc.aio.AioRpcError as e:
            return [e.code(), *codes]
        return [grpc.StatusCode.OK, *codes]

    async def settle(self) -> None:
        """Release what generated prefills left pinned; every worker answers at once."""
        for worker, lease in self.leases:
            await self.stubs[worker].Release(worker_pb2.ReleaseRequest(lease_id=lease),
                                             timeout=10)
        self.leases.clear()
        for stub in self.stubs.values():
            await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)

    def close(self) -> None:
        for ch in self.channels.values():
            self.run(ch.close())
        self.loop.close()


def _status(code: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == code)


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fuzz-workers"), str(tiny_models["llama"]), both=1,
                worker_args=WORKER_ARGS, router_args=["--http-port", "-1"]).start()
    s = Stack(c)
    yield s
    s.close()
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(autouse=True)
def settled(stack):
    yield
    stack.run(stack.settle())
    asyncio.run(stack.cluster.wait_idle(timeout=20))


def _overrides(stack: Stack) -> dict[str, st.SearchStrategy]:
    prefill = stack.workers["prefill0"]
    return {
        # Loopback only: the real prefill worker, a closed port, and addresses that are none.
        "tandem.v1.KVLocation.address": st.sampled_from(
            [prefill, "127.0.0.1:1", "[::1]:1", "localhost:1", "", "no-port", ":", "127.0.0.1:x"]),
        # Token ids in and around the tiny model's vocabulary (512), so that some prompts run.
        "tandem.v1.PrefillRequest.prompt_token_ids": st.one_of(
            st.lists(st.integers(0, 520), max_size=40), st.just([5] * 100_000)),
        "tandem.v1.GenerateOnWorkerRequest.prompt_token_ids": st.lists(st.integers(0, 520),
                                                                      max_size=40),
    }


def _with_cancels(msgs: list[worker_pb2.StreamRequest]) -> list[worker_pb2.StreamRequest]:
    """The messages, then a cancel for each request among them: none runs to its length."""
    ids = [getattr(m, m.WhichOneof("kind")).request_id for m in msgs
           if m.WhichOneof("kind") in ("generate", "decode")]
    return [*msgs, *(worker_pb2.StreamRequest(cancel=rid) for rid in ids)]


# Each RPC, on the workers whose role serves it (the others answer UNIMPLEMENTED, which one
# example each shows).
SERVED = {"prefill0": ("Prefill", "ClaimLease", "Release", "RenewLeases", "Register", "Abort",
                       "GetLoad", "WatchKV", "Move", "LendPrefix"),
          # Decode workers lend running sequences to their peers (live migration): they
          # answer the lease RPCs too. Move: every role answers (only decode moves).
          # LendPrefix: every role answers (a colocated worker lends nothing).
          "decode0": ("Stream", "ClaimLease", "Release", "RenewLeases", "Register", "Abort",
                      "GetLoad", "WatchKV", "Move", "LendPrefix"),
          "both0": ("Stream", "ClaimLease", "Release", "RenewLeases", "Register", "Abort",
                    "GetLoad", "WatchKV", "Move", "LendPrefix")}


def test_every_rpc_of_the_proto_is_fuzzed():
    # Drain takes an empty message (nothing to fuzz) and ends the worker: tests/integration/
    # test_drain.py calls it. SwitchRole drains the worker too, and changes its role:
    # tests/integration/test_role_change.py calls it, tests/unit/test_role_switch.py its checks.
    assert set(METHODS) == set(WORKER_CALLERS) == {m for ms in SERVED.values() for m in ms} | {
        "Drain", "SwitchRole"}


@pytest.mark.parametrize("worker,method", [(w, m) for w, ms in SERVED.items() for m in ms])
def test_any_message_gets_a_callers_status(stack, worker, method):
    request = messages(METHODS[method].input_type, _overrides(stack))
    if method == "Stream":
        request = st.lists(request, min_size=1, max_size=3).map(_with_cancels)

    @FUZZ
    @given(msg=request)
    def check(msg):
        codes = stack.run(stack.call(worker, method, msg))
        stack.codes.update(codes)
        assert set(codes) <= CALLER_CODES, (worker, method, codes)

    check()


def test_a_method_a_role_does_not_serve_is_unimplemented(stack):
    for worker, served in SERVED.items():
        # Every role drains, and answers SwitchRole (with why it cannot, for a colocated one).
        for method in sorted(set(METHODS) - set(served) - {"Drain", "SwitchRole"}):
            assert stack.run(_unserved(stack, worker, method)) == [
                grpc.StatusCode.UNIMPLEMENTED], (worker, method)


async def _unserved(stack: Stack, worker: str, method: str) -> list[grpc.StatusCode]:
    """A call of a method the worker's role does not serve, with an empty message. A Stream is
    refused at its start: a message written meanwhile fails, and gRPC's client reports INTERNAL
    for it instead of the worker's status (grpc/grpc#36066, seen under load), so nothing is
    sent before the call's end."""
    request = METHODS[method].input_type._concrete_class()
    ended = asyncio.Event()
    if method == "Stream":
        async def nothing():
            await ended.wait()
            return
            yield

        request = nothing()
    try:
        return await stack.call(worker, method, request)
    finally:
        ended.set()
