"""The engine in its own process (the engine core) as the services drive it: each step's outputs
of a request reach its sink in order and add up to the offline engine's output; a sink that
raises fails its own request alone; a cancelled request is aborted; a load error comes back
whole; the core's death fails what is in flight. Every test that leaves the core alive ends with
the pool idle."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

import pytest

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sequence import SeqOutput
from engine.serving.async_engine import AsyncEngine, EngineDead
from engine.serving.engine_core import CoreSpec

PROMPTS = [[3 + i, 11, 29 + 2 * i, 7] * (1 + i) for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return str(tiny_models["llama"])


def serve(model_dir: str, body: Callable[[AsyncEngine], Awaitable[None]], **hooks) -> None:
    """Run `body` against a started AsyncEngine; the pool must be idle afterwards."""
    async def main() -> None:
        engine = AsyncEngine(CoreSpec(EngineConfig(model=model_dir, max_model_len=256), "both"),
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


def test_sinks_get_each_step_in_order_and_add_up_to_offline(model_dir):
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

    serve(model_dir, body)
    for i, steps in enumerate(calls):
        got = [[t for outs in steps for o in outs if o.sample_index == k for t in o.new_token_ids]
               for k in range(len(expected[i]))]
        assert got == expected[i], i
        # One call per step, one token per sample in it; the finish comes with the last token.
        assert all(len(o.new_token_ids) == 1 for outs in steps for o in outs)
        ends = [o for outs in steps for o in outs if o.finish_reason is not None]
        assert sorted(o.sample_index for o in ends) == list(range(len(expected[i])))


def test_a_sink_that_raises_fails_its_request_alone(model_dir):
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

    serve(model_dir, body)
    assert len(seen) == 3  # nothing more after it failed


def test_a_cancelled_request_is_aborted_and_its_id_free_again(model_dir):
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

    serve(model_dir, body)


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
