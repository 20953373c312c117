"""Incremental detokenization with stop strings, shared by the offline engine and the router.

Two stages per token:

1. Token ids -> stable text. The ids are decoded in a short window (vLLM's prefix/read offsets):

       window:  [ context: tokens last emitted ][ tokens not yet emitted ]
                0 ......................... read_offset ................ end
       delta = decode(window)[len(decode(window[:read_offset])):]

   After a delta is emitted the window slides: the tokens just read become the context.
   Decoding with that context instead of the new token alone keeps context-dependent
   decoders right (SentencePiece strips the space of the *first* token of a decode; with one
   token of context the new token keeps it). Text is held while the decode ends in U+FFFD:
   that is an incomplete UTF-8 character whose remaining bytes are in later tokens. The window
   is seeded with the prompt's last tokens, so the first output token reads as it does after
   the prompt (" Hello", not "Hello"). tokenizers' DecodeStream does the same stepping, but
   hides its window, and flush() needs it to decode a trailing partial character.

2. Stable text -> emitted text. With stop strings, the longest tail of the text that is a
   proper prefix of some stop string is held back (at most max(len(stop)) - 1 characters, often
   none), so a stop string that spans tokens never leaks. The stop that completes first wins
   and the text is cut exactly before it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens that seed the decode window: enough context for the first output token.
SEED_TOKENS = 4
MAX_SEED_TOKENS = 24
# A decode that still ends in U+FFFD after this many held tokens is a real U+FFFD in the text,
# not a character waiting for its bytes (a UTF-8 character has at most 4 bytes). Emitting it
# bounds the window, so a model that prints U+FFFD over and over stays O(1) per token.
MAX_HELD_TOKENS = 32


@dataclass(frozen=True)
class DetokenizerStep:
    """What one push produced: text safe to show, and whether a stop string ended the output."""

    text_delta: str
    stopped: bool = False
    stop_reason: str | None = None  # the stop string matched


class IncrementalDetokenizer:
    """Turns one output's token ids into text, chunk by chunk.

    Invariant: the concatenation of every push()'s text_delta and flush() equals the decode
    of the output after the prompt, cut before the first stop string to complete. For a
    byte-level tokenizer (Llama 3, Qwen, GPT-2, tandem-demo) that is `tokenizer.decode(output
    ids)`; for a SentencePiece one it may differ from it by the leading space that a lone
    decode strips from the first token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = ()) -> None:
        self._decode = tokenizer.backend.decode
        self._skip = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        seed = self._seed(list(prompt_token_ids))
        self._ids = seed  # the decode window, see the module docstring
        self._read_offset = len(seed)
        self._prefix_text = self._decode(seed, skip_special_tokens=self._skip) if seed else ""
        self._held = ""  # stable text held back: it may be the start of a stop string
        self._pieces: list[str] = []
        self.output_token_ids: list[int] = []
        self.stopped = False
        self.stop_reason: str | None = None
        self.stop_at: int | None = None  # where the stop string starts in the output's text
        self._flushed = False
        # Per output token: the stable text before it (where its own text starts).
        self._token_starts: list[int] = []
        self._stable = 0

    @property
    def text(self) -> str:
        """Every character emitted so far."""
        return "".join(self._pieces)

    def push(self, token_ids: Sequence[int]) -> DetokenizerStep:
        """Add generated tokens; return the text they make safe to show. After a stop string
        has matched, nothing more is taken: the result stays stopped with no text, and
        output_token_ids ends at the token that completed the stop string."""
        if self._flushed:
            raise RuntimeError("push() after flush()")
        if self.stopped:
            return DetokenizerStep("", True, self.stop_reason)
        out: list[str] = []
        for tid in token_ids:
            # One token at a time, so a stop in the middle of a multi-token push leaves
            # output_token_ids ending at the token that completed it.
            self.output_token_ids.append(tid)
            self._token_starts.append(self._stable)
            new = self._step(tid)
            self._stable += len(new)
            if new:
                out.append(self._emit(new, final=False))
                if self.stopped:
                    break
        return DetokenizerStep("".join(out), self.stopped, self.stop_reason)

    def flush(self) -> str:
        """At the end of the output (length, EOS, stop token): the text still held, i.e. a
        trailing incomplete character (as U+FFFD, as a full decode gives it) and any tail
        held for stop strings. Never text at or after a stop string; a stop string found
        here sets `stopped` and `stop_reason`."""
        if self._flushed or self.stopped:
            self._flushed = True
            return ""
        self._flushed = True
        rest = self._decode(self._ids, skip_special_tokens=self._skip)
        return self._emit(rest[len(self._prefix_text):], final=True)

    def tokens_before(self, chars: int) -> int:
        """How many output tokens start before character `chars` of the output's text (with
        stop_at: the tokens whose text the stop string did not remove)."""
        return bisect.bisect_left(self._token_starts, chars)

    # -- token ids -> stable text ---------------------------------------------------------

    def _seed(self, prompt: list[int]) -> list[int]:
        """The shortest tail of the prompt (at least SEED_TOKENS) that decodes without U+FFFD.
        A tail that starts inside a character would decode differently once output bytes
        follow it (byte-fallback decoders turn a whole invalid byte run into U+FFFDs); one that
        ends inside a character would merge with the output's first bytes. Without a clean
        tail, the output is decoded on its own."""
        for n in range(min(SEED_TOKENS, len(prompt)), min(MAX_SEED_TOKENS, len(prompt)) + 1):
            seed = prompt[len(prompt) - n:]
            if REPLACEMENT not in self._decode(seed, skip_special_tokens=self._skip):
                return seed
        return []

    def _step(self, tid: int) -> str:
        """Add one token; return the text it completes ("" while it is held)."""
        self._ids.append(tid)
        text = self._decode(self._ids, skip_special_tokens=self._skip)
        if len(text) <= len(self._prefix_text):  # no text yet (e.g. skipped special tokens)
            return ""
        held = len(self._ids) - self._read_offset
        if text.endswith(REPLACEMENT) and held < MAX_HELD_TOKENS:
            return ""
        new = text[len(self._prefix_text):]
        del self._ids[:self._read_offset]  # slide: the tokens just read become the context
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids, skip_special_tokens=self._skip)
        return new

    # -- stable text -> emitted text ------------------------------------------------------

    def _emit(self, new: str, final: bool) -> str:
        buf = self._held + new
        # `_held` holds no complete stop string, so a match here ends inside `new`; and no
        # match can start in text already emitted (it was not the start of a stop string).
        hit = _first_stop(buf, self._stop)
        if hit is not None:
            cut, reason = hit
            self.stopped, self.stop_reason = True, reason
            self.stop_at = len(self.text) + cut  # `_held` follows the text emitted so far
            self._held = ""
            return self._add(buf[:cut])
        keep = 0 if final else _partial_stop_len(buf, self._stop)
        self._held = buf[len(buf) - keep:] if keep else ""
        return self._add(buf[:len(buf) - keep])

    def _add(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the stop string that completes first in `text`, as if the text
    arrived one character at a time; of those completing at the same character, the longest.
    So the result does not depend on how the text was split into tokens."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        i = text.find(s)
        if i >= 0:
            cand = (i + len(s), i, s)
            if best is None or cand[:2] < best[:2]:
                best = cand
    return None if best is None else (best[1], best[2])


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        # Candidate starts: where s's first character occurs in the last len(s) - 1 chars.
        j = text.find(s[0], max(len(text) - len(s) + 1, 0))
        while j != -1 and len(text) - j > best:
            if s.startswith(text[j:]):
                best = len(text) - j
                break
            j = text.find(s[0], j + 1)
    return best
