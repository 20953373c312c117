"""Structured-output schemas checked off the router's event loop, within a time budget.

    Frontend.stream ─check(fmt)─▶ SchemaChecker ── verdict cached (LRU) ───────────────▶ ok / 400
                                       │ not cached: one check per schema text
                                       ▼
                          checker process (python -m tandem.router_svc.schema_check, niced
                          once started)
                          the schema's grammar compiled against the model's tokenizer,
                          as a worker compiles it ── answer within budget_s ─▶ verdict
                                                  └─ no answer: killed ─▶ refused, 400

Building a grammar can take from milliseconds to minutes (1,000 properties with the pattern
[a-z]{1,300}; one property with [a-z]{1,5000}) and cannot be interrupted, so it runs in a
process that can be killed: past the budget the process is killed and replaced, and the
request refused with a 400 naming the field. The process compiles exactly what a worker's
engine will (engine/grammar.py: the strict-strings grammar, the model's tokenizer and EOS ids),
so a schema that passes here costs a worker about as long, on a thread beside its step loop.
Up to `processes` checks run at once; every verdict, refusals and timeouts included, is kept
(LRU), so a schema sent again costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

from tandem.engine.sampling_params import ResponseFormat
from tandem.errors import InvalidArgument
from tandem.runtime.security import API_KEY_ENV, API_KEY_FILE_ENV

DEFAULT_BUDGET_S = 5.0
START_TIMEOUT_S = 120.0  # for a checker process to load the tokenizer (not part of any budget)
CACHE_SIZE = 1024  # verdicts kept, least recently used dropped first
# The checkers yield the CPU to the router's event loop while they compile. Not while they
# start (imports, the tokenizer: a few seconds of CPU that a request waits for): niced, a start
# beside two CPU-bound processes on a 2-core machine took ~100 s, past START_TIMEOUT_S.
NICENESS = 10


class SchemaChecker:
    """Whether a response format's grammar can be built for this model within `budget_s`."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 budget_s: float = DEFAULT_BUDGET_S, processes: int = 2,
                 cache_size: int = CACHE_SIZE) -> None:
        self.argv = [sys.executable, "-m", "tandem.router_svc.schema_check", str(model_dir),
                     str(vocab_size), *map(str, eos_token_ids)]
        self.budget_s = budget_s
        self.processes = processes
        self.cache_size = cache_size
        # By the schema's digest (a schema may be 64 KiB): its refusal, or None.
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._checking: dict[bytes, asyncio.Future[str | None]] = {}
        self._idle: list[_Checker] = []
        self._slots = asyncio.Semaphore(processes)  # checks at once, each on its own process
        self.num_checked = 0  # schemas sent to a checker process (not answered from the cache)

    async def check(self, fmt: ResponseFormat, field: str = "response_format") -> None:
        """InvalidArgument naming `field` if `fmt`'s grammar cannot be built, or not within the
        budget."""
        # Every kind, json_object too: a checker without xgrammar refuses them all.
        spec = json.dumps([fmt.type, fmt.schema, fmt.after])
        key = hashlib.sha256(spec.encode()).digest()
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        else:
            task = self._checking.get(key)
            if task is None:
                task = self._checking[key] = asyncio.ensure_future(self._check(key, spec))
                task.add_done_callback(lambda _: self._checking.pop(key, None))
            verdict = await asyncio.shield(task)  # a caller leaving leaves the check running
        if verdict is not None:
            raise InvalidArgument(field, verdict)

    async def _check(self, key: bytes, spec: str) -> str | None:
        async with self._slots:
            try:
                checker = self._idle.pop() if self._idle else await _Checker.start(self.argv)
            except (OSError, RuntimeError, TimeoutError, ValueError) as e:
                raise _unavailable(e) from None  # the router's fault, not the schema's
            self.num_checked += 1
            try:
                verdict = await asyncio.wait_for(checker.ask(spec), self.budget_s)
            except TimeoutError:
                verdict = (f"the schema's grammar takes longer than {self.budget_s:g} s to "
                           "build (the router's --grammar-budget)")
                await checker.close()
            except (OSError, EOFError, ValueError):  # the process died on it
                verdict = "the schema could not be checked (its checker exited)"
                await checker.close()
            except BaseException:  # cancelled: the process may be mid-build
                await checker.close()
                raise
            else:
                self._idle.append(checker)
        self._verdicts[key] = verdict
        if len(self._verdicts) > self.cache_size:
            self._verdicts.popitem(last=False)
        return verdict

    async def close(self) -> None:
        """Stop every checker process (a check in flight is cancelled)."""
        tasks = list(self._checking.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        idle, self._idle = self._idle, []
        for checker in idle:
            await checker.close()


def _unavailable(e: Exception) -> Exception:
    """A checker that did not start: UNAVAILABLE (HTTP 503), no verdict remembered."""
    import grpc  # noqa: PLC0415 - the checker process runs this module: none of the router

    from tandem.router_svc.decode_legs import RouterError  # noqa: PLC0415 - as above

    return RouterError(grpc.StatusCode.UNAVAILABLE, f"the schema checker did not start: {e}")


class _Checker:
    """One checker process: a schema as a line of JSON in, a verdict as a line out."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, argv: list[str]) -> _Checker:
        env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, API_KEY_FILE_ENV)}
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 20, env=env)  # no API key: it has no use for one
        checker = cls(proc)
        try:
            try:
                ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                raise TimeoutError(f"not ready within {START_TIMEOUT_S:g} s") from None
            if json.loads(ready or b"null") != {"ready": True}:
                raise RuntimeError(f"it answered {ready[:200]!r}")
        except BaseException:
            await checker.close()
            raise
        return checker

    async def ask(self, spec: str) -> str | None:
        """`spec`: a format as the JSON text of [type, schema, after]."""
        self.proc.stdin.write(spec.encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise EOFError("the schema checker exited")
        return json.loads(line)["refused"]

    async def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


# -- the checker process -----------------------------------------------------------------------
def _serve(model_dir: str, vocab_size: int, eos_token_ids: list[int]) -> None:
    """Answer each format ([type, schema, after] as JSON, one per line on stdin) with
    {"refused": reason or null}."""
    from tandem.engine.grammar import GrammarCompiler  # noqa: PLC0415 - the process's only work

    compiler = GrammarCompiler(Path(model_dir), vocab_size, eos_token_ids, cache_size=1)
    unavailable = None
    try:
        compiler.compile(ResponseFormat("json_object"))  # loads the tokenizer: before "ready"
    except InvalidArgument as e:  # xgrammar missing: every check says so
        unavailable = e.message
    with contextlib.suppress(OSError):  # started at the caller's priority: see NICENESS
        os.nice(NICENESS)
    _reply({"ready": True})
    for line in sys.stdin:
        refused = unavailable
        if refused is None:
            try:
                compiler.compile(ResponseFormat(*json.loads(line)))
            except InvalidArgument as e:
                refused = e.message
        _reply({"refused": refused})


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3:]])
