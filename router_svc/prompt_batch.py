"""Several prompts as one request (the OpenAI completions endpoint's batch form, and gRPC's
`prompts`): one Frontend stream per prompt, run together and read as one.

    prompt 0 ─ Frontend.stream ─┐
    prompt 1 ─ Frontend.stream ─┼─▶ steps: prompt i's sample j is choice i * n + j;
    ...                         ┘          usage summed over the prompts

Every prompt's first step (its checks, admission and the choice of workers) is taken before
any step is given out, so a request refused for one prompt is refused whole, before a byte of
its answer; leaving early closes every prompt's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from tandem.errors import InvalidArgument
from tandem.router_svc.frontend import Delta, Usage

MAX_PROMPTS = 256  # each is a request of its own on the workers

Step = tuple[list[Delta], Usage]


def check_count(count: int) -> None:
    if not 1 <= count <= MAX_PROMPTS:
        raise InvalidArgument("prompt", f"give 1 to {MAX_PROMPTS} prompts, got {count}")


async def merged(streams: list[AsyncIterator[Step]], n: int) -> AsyncIterator[Step]:
    """The steps of `streams` (one per prompt, each of n samples) as one request's."""
    usages = [Usage() for _ in streams]
    try:
        async with asyncio.TaskGroup() as tg:  # one refusal cancels the others' first steps
            firsts = [tg.create_task(anext(s, None)) for s in streams]
        queue: asyncio.Queue[tuple[int, Step | None]] = asyncio.Queue()
        for i, first in enumerate(firsts):
            queue.put_nowait((i, first.result()))
        readers = [asyncio.create_task(_read(i, s, queue)) for i, s in enumerate(streams)]
        try:
            open_ = len(streams)
            while open_:
                i, step = await queue.get()
                if isinstance(step, BaseException):
                    raise step
                if step is None:
                    open_ -= 1
                    continue
                deltas, usages[i] = step
                yield ([dataclasses.replace(d, index=i * n + d.index) for d in deltas],
                       _total(usages))
        finally:
            for r in readers:
                r.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
    except BaseExceptionGroup as eg:  # the first refusal, as a single prompt's would be
        raise eg.exceptions[0] from None
    finally:
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()  # type: ignore[attr-defined]


async def _read(i: int, stream: AsyncIterator[Step], queue: asyncio.Queue) -> None:
    """Prompt i's steps after its first, then None (or the error that ended it)."""
    try:
        async for step in stream:
            queue.put_nowait((i, step))
    except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
        queue.put_nowait((i, e))
        return
    queue.put_nowait((i, None))


def _total(usages: list[Usage]) -> Usage:
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 sum(u.cached_prompt_tokens for u in usages))
