"""Steps of one request that queued up before the router read them go on as one update: when
the router's loop falls behind the workers, each request then costs it one message per read,
not one per step. Tokens, logprobs and finish reasons arrive whole and in order, and an end
(or a move) behind the tokens is still seen after them."""

from __future__ import annotations

import asyncio

from tandem.router_svc.worker_stream import SampleUpdate, Update, WorkerStream
from tandem.v1 import worker_pb2


def step(rid: str, tokens: dict[int, list[int]], finished: set[int] = frozenset()
         ) -> worker_pb2.StreamResponse:
    """One engine step's message: each sample's new tokens, 'length' for those in finished."""
    resp = worker_pb2.StreamResponse()
    cols = resp.tokens
    for sample, ids in tokens.items():
        cols.request_id.append(rid)
        cols.sample_index.append(sample)
        cols.num_tokens.append(len(ids))
        cols.token_ids.extend(ids)
        cols.finish_reason.append("length" if sample in finished else "")
        cols.num_prompt_tokens.append(3)
        cols.num_cached_tokens.append(0)
        cols.with_logprobs.append(False)
    return resp


class BurstCall:
    """A Stream call whose worker sends `messages` back to back once the request is read (no
    await between them: all of them are queued before the request's reader runs)."""

    def __init__(self, requests, messages: list[worker_pb2.StreamResponse]) -> None:
        self.requests, self.messages = requests, messages

    async def _gen(self):
        await anext(self.requests)  # the generate request
        for m in self.messages:
            yield m
        await asyncio.Event().wait()  # the call stays open

    def __aiter__(self):
        return self._gen()

    def cancel(self) -> None:
        pass


class BurstStub:
    def __init__(self, messages: list[worker_pb2.StreamResponse]) -> None:
        self.messages = messages

    def Stream(self, requests):  # noqa: N802 - gRPC method name
        return BurstCall(requests, self.messages)


def generate(rid: str, n: int = 1) -> worker_pb2.StreamRequest:
    msg = worker_pb2.StreamRequest(generate=worker_pb2.GenerateOnWorkerRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3]))
    msg.generate.params.n = n
    return msg


def test_steps_queued_before_they_are_read_arrive_as_one_update_and_the_end_after_them():
    done = worker_pb2.StreamResponse(updates=[worker_pb2.RequestUpdate(request_id="r",
                                                                        done=True)])
    messages = [step("r", {0: [5], 1: [6]}), step("r", {0: [7], 1: [8, 9]}),
                step("r", {1: [10]}, finished={1}), step("r", {0: [11]}, finished={0}), done]

    async def main() -> list[Update]:
        ws = WorkerStream(BurstStub(messages), "fake")
        got = [u async for u in ws.request(generate("r", n=2))]
        await ws.close()
        return got

    got = asyncio.run(main())
    assert len(got) == 1  # four steps, read once
    samples = {s.index: s for s in got[0].samples}
    assert samples[0].token_ids == [5, 7, 11] and samples[0].finish_reason == "length"
    assert samples[1].token_ids == [6, 8, 9, 10] and samples[1].finish_reason == "length"
    assert len(samples[0].logprobs) == 3 and len(samples[1].logprobs) == 4


def test_a_move_behind_queued_steps_comes_after_their_tokens():
    move = worker_pb2.StreamResponse(updates=[worker_pb2.RequestUpdate(request_id="r",
                                                                        move=True)])
    messages = [step("r", {0: [5]}), step("r", {0: [6]}), move, step("r", {0: [7]})]

    async def main() -> list[Update]:
        ws = WorkerStream(BurstStub(messages), "fake")
        call = ws.request(generate("r"))
        got = [await anext(call) for _ in range(3)]
        await call.aclose()
        await ws.close()
        return got

    first, moved, after = asyncio.run(main())
    assert [s.token_ids for s in first.samples] == [[5, 6]]
    assert moved.move and moved.samples == []
    assert [s.token_ids for s in after.samples] == [[7]]


def test_absorb_keeps_the_first_prompt_logprobs_and_adds_new_samples():
    a = Update([SampleUpdate(0, [1], [None], None)], 3, 0, prompt_logprobs=[])
    a.absorb(Update([SampleUpdate(1, [2], [None], "stop")], 3, 2, prompt_logprobs=None))
    assert [(s.index, s.token_ids, s.finish_reason) for s in a.samples] == \
        [(0, [1], None), (1, [2], "stop")]
    assert a.prompt_logprobs == [] and a.num_cached_tokens == 2
