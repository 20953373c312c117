"""Incremental detokenization and stop strings.

Properties, for any split of the output into pushes:
- the emitted text (deltas + flush) is the decode of the output, cut before the first stop
  string to complete (as if text arrived one character at a time);
- everything emitted so far is a prefix of that final text: nothing is ever taken back, so a
  stop string (or a broken character) never reaches a client.

"The decode of the output" is `tokenizer.decode(output)` for byte-level tokenizers, and the
output as it reads after the prompt for SentencePiece ones (a lone decode strips the first
token's leading space).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.demo import BOS_ID, EOT_ID, VOCAB_SIZE
from tandem.engine.detokenizer import MAX_HELD_TOKENS, DetokenizerStep, IncrementalDetokenizer
from tandem.engine.tokenizer import Tokenizer

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
# Code points that stress the byte handling: 2-, 3- and 4-byte UTF-8, a skin-tone modifier,
# regional indicators, a combining accent.
TRICKY = list("aé€😀日本👍🏽🇫🇷ü \n.\u0301")
text_st = st.text(alphabet=st.one_of(st.sampled_from(TRICKY), st.characters(codec="utf-8")),
                  max_size=8)
chunks_st = st.lists(st.integers(1, 5), min_size=1, max_size=8)


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i:i + n])
        i, k = i + n, k + 1
    return out


def reference_cut(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Character by character: stop at the first position where a stop string ends (the
    longest, if several end there)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return text[:end - len(s)], s
    return text, None


def stream(tok: Tokenizer, prompt: list[int], out: list[int], sizes: list[int],
           skip: bool = True, stop: tuple[str, ...] = (), final: str | None = None,
           ) -> tuple[IncrementalDetokenizer, list[str]]:
    """Push `out` in chunks, checking after each push that the emitted text is a prefix of
    `final` (the expected end result); then flush. Returns the detokenizer and the deltas."""
    det = IncrementalDetokenizer(tok, prompt, skip, stop)
    deltas = []
    for chunk in split(out, sizes):
        step = det.push(chunk)
        deltas.append(step.text_delta)
        assert det.text == "".join(deltas)
        if final is not None:
            assert final.startswith(det.text), (det.text, final)
        if step.stopped:
            break
    deltas.append(det.flush())
    return det, deltas


def check(tok: Tokenizer, prompt: list[int], out: list[int], sizes: list[int], skip: bool,
          stop: tuple[str, ...], full: str) -> IncrementalDetokenizer:
    """`full`: the whole output's text. Asserts the streamed result is `full` cut at stops."""
    want, reason = reference_cut(full, stop)
    det, deltas = stream(tok, prompt, out, sizes, skip, stop, want)
    assert "".join(deltas) == want
    assert det.stopped == (reason is not None) and det.stop_reason == reason
    assert out[:len(det.output_token_ids)] == det.output_token_ids
    if reason is None:
        assert det.output_token_ids == out
    return det


def context_decode(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool) -> str:
    """The output's text as it reads after the prompt."""
    before = tok.decode(prompt, skip_special_tokens=skip)
    both = tok.decode(prompt + out, skip_special_tokens=skip)
    assert both.startswith(before)  # holds for valid UTF-8 (the strategies below ensure it)
    return both[len(before):]


# -- properties ----------------------------------------------------------------------------

@st.composite
def demo_ids(draw, max_pieces: int = 10) -> list[int]:
    """Any ids, including special tokens, lone bytes, and whole characters split into bytes."""
    pieces = draw(st.lists(st.one_of(
        st.integers(0, VOCAB_SIZE - 1).map(lambda i: [i]),
        text_st.map(lambda t: list(t.encode())),
    ), max_size=max_pieces))
    return [i for p in pieces for i in p]


@SETTINGS
@given(prompt=demo_ids(4), out=demo_ids(), sizes=chunks_st, skip=st.booleans())
def test_demo_deltas_equal_full_decode(demo, prompt, out, sizes, skip):
    check(demo, prompt, out, sizes, skip, (), demo.decode(out, skip_special_tokens=skip))


@SETTINGS
@given(data=st.data(), sizes=chunks_st, skip=st.booleans())
def test_bytelevel_bpe_deltas_equal_full_decode(bpe, data, sizes, skip):
    # Learned merges: one token may hold the end of one character and the start of the next.
    ids = st.lists(st.one_of(st.integers(0, bpe.vocab_size - 1).map(lambda i: [i]),
                             text_st.map(lambda t: bpe.encode(t))), max_size=10)
    prompt = [i for piece in data.draw(ids) for i in piece]
    out = [i for piece in data.draw(ids) for i in piece]
    check(bpe, prompt, out, sizes, skip, (), bpe.decode(out, skip_special_tokens=skip))


@st.composite
def sp_ids(draw, tok: Tokenizer) -> list[int]:
    """Valid text only: byte-fallback decoding turns a whole run of byte tokens into U+FFFDs
    when any of it is invalid, which no streaming decoder can follow. Special tokens go
    between pieces."""
    specials = tok.encode("<s></s><unk>", add_special_tokens=False)
    pieces = draw(st.lists(st.one_of(
        text_st.map(lambda t: tok.encode(t, add_special_tokens=False)),
        st.sampled_from(specials).map(lambda i: [i]),
    ), max_size=8))
    return [i for p in pieces for i in p]


@SETTINGS
@given(data=st.data(), sizes=chunks_st, skip=st.booleans())
def test_sentencepiece_deltas_equal_context_decode(sp, data, sizes, skip):
    prompt = data.draw(st.one_of(st.just([]), text_st.map(sp.encode)))
    out = data.draw(sp_ids(sp))
    full = context_decode(sp, prompt, out, skip)
    check(sp, prompt, out, sizes, skip, (), full)
    # Against a lone decode the only difference is the first token's leading space.
    alone = sp.decode(out, skip_special_tokens=skip)
    assert full in (alone, " " + alone)


STOP_ALPHABET = list("ab€😀 \n")
stop_text_st = st.text(alphabet=st.sampled_from(STOP_ALPHABET), max_size=30)
stops_st = st.lists(st.text(alphabet=st.sampled_from(STOP_ALPHABET), min_size=1, max_size=4),
                    min_size=1, max_size=3).map(tuple)


@SETTINGS
@given(text=stop_text_st, stop=stops_st, sizes=chunks_st)
def test_demo_stop_strings(demo, text, stop, sizes):
    out = demo.encode(text, add_special_tokens=False)
    det = check(demo, [BOS_ID], out, sizes, True, stop, text)
    if det.stopped:
        # One byte per token: the stop is caught on the very token that completes it.
        ids = det.output_token_ids
        cut, reason = reference_cut(demo.decode(ids), stop)
        assert reason == det.stop_reason and cut == det.text
        assert reference_cut(demo.decode(ids[:-1]), stop)[1] is None


@SETTINGS
@given(text=stop_text_st, stop=stops_st, sizes=chunks_st)
def test_bytelevel_bpe_stop_strings(bpe, text, stop, sizes):
    out = bpe.encode(text)
    check(bpe, [], out, sizes, True, stop, text)


@SETTINGS
@given(prompt_text=stop_text_st, text=stop_text_st, stop=stops_st, sizes=chunks_st)
def test_sentencepiece_stop_strings(sp, prompt_text, text, stop, sizes):
    prompt = sp.encode(prompt_text)
    out = sp.encode(text, add_special_tokens=False)
    check(sp, prompt, out, sizes, True, stop, context_decode(sp, prompt, out, True))


# -- examples ------------------------------------------------------------------------------

def bytes_of(text: str) -> list[int]:
    return list(text.encode())  # demo token ids are byte values


def test_stop_spanning_tokens_is_held_then_cut(demo):
    det = IncrementalDetokenizer(demo, [BOS_ID], True, ("STOP",))
    deltas = [det.push([i]) for i in bytes_of("ab STO")]
    assert [d.text_delta for d in deltas] == ["a", "b", " ", "", "", ""]
    assert det.push(bytes_of("P")) == DetokenizerStep("", True, "STOP")
    assert det.text == "ab "
    assert det.output_token_ids == bytes_of("ab STOP")
    # After the stop: nothing more is taken or emitted.
    assert det.push(bytes_of(" more")) == DetokenizerStep("", True, "STOP")
    assert det.output_token_ids == bytes_of("ab STOP")
    assert det.flush() == "" and det.text == "ab "


def test_stop_in_the_middle_of_a_multi_token_push(demo):
    det = IncrementalDetokenizer(demo, [], True, ("STOP",))
    step = det.push(bytes_of("ab STOP cd"))
    assert step == DetokenizerStep("ab ", True, "STOP")
    assert det.output_token_ids == bytes_of("ab STOP")


def test_held_prefix_of_a_stop_is_flushed_at_the_end(demo):
    det = IncrementalDetokenizer(demo, [], True, ("STOP",))
    assert det.push(bytes_of("abST")).text_delta == "ab"
    assert det.flush() == "ST"
    assert det.text == "abST" and not det.stopped


def test_only_a_possible_stop_start_is_held(demo):
    # Text that cannot begin a stop string streams without delay.
    det = IncrementalDetokenizer(demo, [], True, ("\n\nUser:",))
    assert [det.push([i]).text_delta for i in bytes_of("hi\n\nUs")] == ["h", "i", "", "", "", ""]
    assert det.push(bytes_of("a")).text_delta == "\n\nUsa"


def test_first_completed_stop_wins(bpe):
    # " quick" is one token: both stops arrive in one step, and "ui" completes first, as it
    # would if the text came character by character.
    out = bpe.encode(" quick")
    assert len(out) == 1
    det, deltas = stream(bpe, [], out, [1], stop=("quick", "ui"))
    assert "".join(deltas) == " q" and det.stop_reason == "ui"
    # Two stops complete on the same character: the longer one cuts.
    det, deltas = stream(bpe, [], out, [1], stop=("k", "ck"))
    assert "".join(deltas) == " qui" and det.stop_reason == "ck"


def test_multibyte_character_split_across_tokens(demo):
    det = IncrementalDetokenizer(demo, [BOS_ID], True, ())
    assert [det.push([i]).text_delta for i in bytes_of("😀")] == ["", "", "", "😀"]


def test_trailing_incomplete_character_flushes_as_full_decode(demo):
    ids = bytes_of("a€")[:-1]
    det = IncrementalDetokenizer(demo, [], True, ())
    assert det.push(ids).text_delta == "a"
    assert det.flush() == "\ufffd" == demo.decode(ids)[1:]


def test_special_tokens(demo):
    for skip, want in ((True, "ab"), (False, "a<|eot_id|>b")):
        det = IncrementalDetokenizer(demo, [], skip, ())
        assert "".join(det.push([i]).text_delta for i in [ord("a"), EOT_ID, ord("b")]) == want


def test_first_token_keeps_its_space_after_the_prompt(sp):
    prompt = sp.apply_chat_template([{"role": "user", "content": "hello there"}])
    out = sp.encode("world peace", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(out)[0].startswith("▁")
    _, deltas = stream(sp, prompt, out, [1])
    assert "".join(deltas) == " world peace"
    assert sp.decode(out) == "world peace"  # a lone decode strips it
    # Without a prompt there is nothing to follow: the output reads as decoded alone.
    _, deltas = stream(sp, [], out, [1])
    assert "".join(deltas) == "world peace"


def test_space_survives_a_run_of_skipped_special_tokens(sp):
    # Tokens that add no text stay in the window, so the context before them still counts.
    prompt = sp.encode("hello there")
    eos = sp.encode("</s>", add_special_tokens=False)
    out = eos * (MAX_HELD_TOKENS + 8) + sp.encode("world", add_special_tokens=False)
    _, deltas = stream(sp, prompt, out, [1])
    assert "".join(deltas) == " world"


def test_prompt_ending_inside_a_character(demo):
    # The prompt ends with the first byte of "€"; the output's bytes cannot complete it
    # (the prompt is already shown), so they decode as they would alone.
    prompt, out = bytes_of("x€")[:-2], bytes_of("€")[1:] + bytes_of("z")
    _, deltas = stream(demo, prompt, out, [1])
    assert "".join(deltas) == demo.decode(out) == "\ufffd\ufffdz"


def test_repeated_replacement_characters_do_not_grow_the_window(demo):
    # U+FFFD in the text itself looks like a character waiting for bytes; after
    # MAX_HELD_TOKENS it is emitted anyway, so each step decodes a bounded window.
    out = bytes_of("\ufffd" * 100 + "ok")
    det = IncrementalDetokenizer(demo, [], True, ())
    longest = 0
    for i in out[:-2]:
        det.push([i])
        longest = max(longest, len(det._ids))
    assert det.text.startswith("\ufffd" * 10)  # emitted before the stream ended
    assert longest <= 2 * MAX_HELD_TOKENS
    det.push(out[-2:])
    assert det.text + det.flush() == demo.decode(out)


def test_push_after_flush_is_an_error(demo):
    det = IncrementalDetokenizer(demo, [], True, ())
    det.push(bytes_of("a"))
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.push(bytes_of("b"))


def test_the_tokens_a_stop_string_removed_are_told_apart(demo):
    """stop_at and tokens_before: which output tokens still have text in the answer (their
    logprobs are reported), and which only made up the stop string or came after it."""
    det = IncrementalDetokenizer(demo, [], True, ("STOP",))
    det.push(bytes_of("ab STOP cd"))
    assert det.stop_at == 3 and det.tokens_before(det.stop_at) == 3
    assert det.tokens_before(det.stop_at + len("STOP")) == 7  # include_stop_str_in_output
    det = IncrementalDetokenizer(demo, [], True, ("X",))
    for b in bytes_of("é X!"):  # a character of two tokens before the stop
        det.push([b])
    assert det.text == "é " and det.stop_at == 2 and det.tokens_before(2) == 3
