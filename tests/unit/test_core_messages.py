"""What crosses the pipe between a worker and its engine core survives it: a step's outputs
(tokens as tuples, the rest whole) and the errors a command can raise."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from tandem.engine.sampling_params import Logprob, TokenLogprobs
from tandem.engine.sequence import FinishReason, SeqOutput
from tandem.engine.serving.core_messages import pack_outputs, portable, unpack_outputs
from tandem.errors import InvalidArgument, LayoutMismatch

outputs = st.builds(
    lambda rid, i, toks, reason, with_lp, error, n: SeqOutput(
        f"r{rid}", i, toks,
        [TokenLogprobs(Logprob(t, -0.5)) if with_lp else None for t in toks],
        reason, n, n // 2, len(toks), error=error),
    st.integers(0, 5), st.integers(0, 3), st.lists(st.integers(0, 50_000), max_size=3),
    st.none() | st.sampled_from(FinishReason), st.booleans(), st.none() | st.just("pull failed"),
    st.integers(1, 4096))


@given(st.lists(outputs, max_size=40))
def test_a_steps_outputs_come_out_of_the_pipe_as_they_went_in(step):
    plain, whole = pickle.loads(pickle.dumps(pack_outputs(step)))
    back = unpack_outputs(plain, whole)
    assert sorted(back, key=repr) == sorted(step, key=repr)  # as a multiset, every field
    # Only outputs that bring plain tokens travel as tuples.
    assert all(o.finish_reason is None and o.error is None for o in back[:len(plain)])


def test_errors_cross_the_pipe_with_their_fields():
    e = pickle.loads(pickle.dumps(portable(InvalidArgument("n", "must be <= 4, got 9"))))
    assert isinstance(e, InvalidArgument) and e.field == "n" and str(e) == "n: must be <= 4, got 9"
    m = pickle.loads(pickle.dumps(portable(LayoutMismatch("head_dim", 64, 128))))
    assert isinstance(m, LayoutMismatch) and m.field == "head_dim" and "remote 128" in str(m)

    class Unpicklable(Exception):
        def __init__(self, a, b):
            super().__init__(a)

    e2 = portable(Unpicklable("boom", 2))
    assert type(e2) is RuntimeError and str(e2) == "Unpicklable: boom"
