"""The engine in its own process (the engine core) as the services drive it: each step's outputs
of a request reach its sink in order and add up to the offline engine's output; a sink that
raises fails its own request alone; a cancelled request is aborted; a load error comes back
whole; the core's death fails what is in flight. Every test that leaves the core alive ends with
the pool idle."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import RemoteKV, SeqOutput
from tandem.engine.serving.async_engine import AsyncEngine, EngineDead, RequestAborted
from tandem.engine.serving.core_messages import CoreSpec
from tandem.errors import InvalidArgument, ModelLoadError

PROMPTS = [[3 + i, 11, 29 + 2 * i, 7] * (1 + i) for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["llama"])


def serve(model_dir: str, body: Callable[[AsyncEngine], Awaitable[None]], role: str = "both",
          **hooks) -> None:
    """Run `body` against a started AsyncEngine; the pool must be idle afterwards."""
    async def main() -> None:
        engine = AsyncEngine(CoreSpec(EngineConfig(model=model_dir, max_model_len=256), role),
                             **hooks)
        await engine.start()
        try:
            await body(engine)
            if not engine.dead:
                assert (await engine.refresh()).idle, "KV pool not back to idle"
            assert engine.num_requests() == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def started(model_dir: str, role: str, **hooks):
    """A started engine core on an event loop of the module's, for the tests that leave it as
    they found it (`on` checks that after each); stopped at the module's end."""
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(CoreSpec(EngineConfig(model=model_dir, max_model_len=256), role),
                         **hooks)
    loop.run_until_complete(engine.start())
    yield loop, engine
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def colocated(model_dir):
    yield from started(model_dir, "both")


@pytest.fixture(scope="module")
def leases_done() -> list:
    """What the decode engine's on_lease_done hook got; each test empties it first."""
    return []


@pytest.fixture(scope="module")
def decoding(model_dir, leases_done):
    yield from started(model_dir, "decode", on_lease_done=leases_done.append)


def on(shared, body: Callable[[AsyncEngine], Awaitable[None]]) -> None:
    """Run `body` against one of the module's engines; the pool must be idle afterwards, as
    `serve` checks for an engine of the test's own."""
    loop, engine = shared

    async def main() -> None:
        await body(engine)
        assert (await engine.refresh()).idle, "KV pool not back to idle"
        assert engine.num_requests() == 0

    loop.run_until_complete(main())


def test_sinks_get_each_step_in_order_and_add_up_to_offline(model_dir, colocated):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    n2 = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=9, ignore_eos=True)
    offline = LLM(model_dir, progress=False, max_model_len=256)
    expected = [[o.token_ids for o in r.outputs]
                for r in offline.generate(PROMPTS, [greedy] * 7 + [n2])]
    calls: list[list[list[SeqOutput]]] = [[] for _ in PROMPTS]

    async def body(engine: AsyncEngine) -> None:
        await asyncio.gather(*(engine.generate(f"r{i}", p, n2 if i == 7 else greedy,
                                               calls[i].append)
                               for i, p in enumerate(PROMPTS)))

    on(colocated, body)
    for i, steps in enumerate(calls):
        got = [[t for outs in steps for o in outs if o.sample_index == k for t in o.new_token_ids]
               for k in range(len(expected[i]))]
        assert got == expected[i], i
        # One call per step, one token per sample in it; the finish comes with the last token.
        assert all(len(o.new_token_ids) == 1 for outs in steps for o in outs)
        ends = [o for outs in steps for o in outs if o.finish_reason is not None]
        assert sorted(o.sample_index for o in ends) == list(range(len(expected[i])))


def test_a_sink_that_raises_fails_its_request_alone(colocated):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seen: list[int] = []

    def failing(outs: list[SeqOutput]) -> None:
        seen.append(len(outs))
        if len(seen) == 3:
            raise ValueError("consumer broke")

    async def body(engine: AsyncEngine) -> None:
        bad = engine.generate("bad", PROMPTS[1], params, failing)
        good_tokens: list[SeqOutput] = []
        good = engine.generate("good", PROMPTS[2], params, good_tokens.extend)
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], ValueError) and results[1] is None
        assert sum(len(o.new_token_ids) for o in good_tokens) == 20

    on(colocated, body)
    assert len(seen) == 3  # nothing more after it failed


def test_a_cancelled_request_is_aborted_and_its_id_free_again(colocated):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body(engine: AsyncEngine) -> None:
        first = asyncio.Event()
        task = asyncio.create_task(engine.generate("x", PROMPTS[3], params,
                                                   lambda outs: first.set()))
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snap = await engine.refresh()  # the abort was posted before this
        assert snap.num_requests == 0 and snap.num_free_blocks == snap.num_blocks
        # The id can be used again at once.
        outs: list[SeqOutput] = []
        await engine.generate("x", PROMPTS[3], SamplingParams(temperature=0, max_tokens=3),
                              outs.extend)
        assert sum(len(o.new_token_ids) for o in outs) == 3

    on(colocated, body)


def test_an_aborted_request_ends_and_its_blocks_are_freed(colocated):
    """`abort` (a worker's Abort call) mid-request: the request's awaitable raises
    RequestAborted, so a stream that waits on it ends; an unknown id aborts nothing."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body(engine: AsyncEngine) -> None:
        first = asyncio.Event()
        task = asyncio.create_task(engine.generate("x", PROMPTS[3], params,
                                                   lambda outs: first.set()))
        await first.wait()
        assert await engine.abort("x")
        with pytest.raises(RequestAborted, match="'x' was aborted"):
            await task
        assert not await engine.abort("x") and not await engine.abort("never-seen")

    on(colocated, body)


def test_a_load_error_comes_back_from_the_core_with_its_message(tmp_path):
    async def main() -> None:
        engine = AsyncEngine(CoreSpec(EngineConfig(model=str(tmp_path / "absent")), "both"))
        with pytest.raises(ModelLoadError, match="absent"):
            await engine.start()
        await engine.shutdown()

    asyncio.run(main())


def test_the_core_dying_fails_what_is_in_flight_and_reports_it(model_dir):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    deaths: list[bool] = []

    async def body(engine: AsyncEngine) -> None:
        first = asyncio.Event()
        task = asyncio.create_task(engine.generate("x", PROMPTS[3], params,
                                                   lambda outs: first.set()))
        await first.wait()
        os.kill(engine.info.pid, signal.SIGKILL)
        with pytest.raises(EngineDead, match="exited"):
            await task
        assert engine.dead and deaths == [True]
        with pytest.raises(EngineDead):
            await engine.generate("y", PROMPTS[0], params, lambda outs: None)
        with pytest.raises(EngineDead):
            await engine.abort("x")

    serve(model_dir, body, on_death=lambda: deaths.append(True))


def test_every_decode_lease_ends_in_exactly_one_lease_done(decoding, leases_done):
    """Decode role: the core says when it is done with each prefill lease, once: after a pull
    (here one that fails: the pool was never mapped), when the core refuses the request; and the
    worker side says it for a request that never reached the core (its id in use)."""
    done = leases_done
    done.clear()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = PROMPTS[2]

    def source(lease: str, blocks: int) -> RemoteKV:
        return RemoteKV("127.0.0.1:1", lease, time.monotonic() + 30, tuple(range(blocks)),
                            (5,), (None,))

    async def body(engine: AsyncEngine) -> None:
        nblocks = -(-len(prompt) // engine.info.layout["block_size"])
        outs: list[SeqOutput] = []  # its pull fails: the request ends with the error
        await engine.decode("pulled", prompt, params, source("L1", nblocks), outs.extend)
        assert [o.error for o in outs] == ["KV transfer failed: the KV pool of 127.0.0.1:1 is "
                                           "not mapped"]
        with pytest.raises(InvalidArgument, match=r"kv\.block_ids"):  # refused by the core
            await engine.decode("refused", prompt, params, source("L2", nblocks + 1), print)
        blocker = asyncio.Event()
        first = asyncio.create_task(engine.generate("busy", prompt, SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True), lambda outs: blocker.set()))
        await blocker.wait()
        with pytest.raises(InvalidArgument, match="request_id"):  # never sent to the core
            await engine.decode("busy", prompt, params, source("L3", nblocks), outs.extend)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await engine.refresh()

    on(decoding, body)
    assert sorted(d.lease_id for d in done) == ["L1", "L2", "L3"]
    by_lease = {d.lease_id: d for d in done}
    assert by_lease["L1"].pulled and "not mapped" in by_lease["L1"].error
    assert not by_lease["L2"].pulled and not by_lease["L3"].pulled


def test_a_decode_request_with_an_out_of_vocabulary_first_token_fails_alone(decoding,
                                                                           leases_done):
    """A first token outside the vocabulary is refused when the request is added (it would
    fail the engine step of every request decoding beside it); its lease ends once; the
    requests running meanwhile finish whole."""
    done = leases_done
    done.clear()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def body(engine: AsyncEngine) -> None:
        started = [asyncio.Event() for _ in range(4)]
        outs: list[list[SeqOutput]] = [[] for _ in range(4)]

        def sink(i: int):
            return lambda o: (outs[i].extend(o), started[i].set())

        running = [asyncio.create_task(engine.generate(f"r{i}", PROMPTS[i], params, sink(i)))
                   for i in range(4)]
        for e in started:
            await e.wait()
        vocab, bs = engine.info.limits.vocab_size, engine.info.layout["block_size"]
        source = RemoteKV("127.0.0.1:1", "L", time.monotonic() + 30,
                              tuple(range(-(-len(PROMPTS[2]) // bs))), (vocab,), (None,))
        with pytest.raises(InvalidArgument, match="first_token_ids"):
            await engine.decode("bad", PROMPTS[2], params, source, print)
        await asyncio.gather(*running)
        assert [sum(len(o.new_token_ids) for o in out) for out in outs] == [30] * 4

    on(decoding, body)
    assert [d.lease_id for d in done] == ["L"]
