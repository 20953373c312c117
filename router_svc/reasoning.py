"""Reasoning split from the answer: Qwen3 (and models with its template) think in
<think>…</think> before answering; the thinking goes to `reasoning_content`.

    <think>\\nplan…\\n</think>\\n\\nanswer      reasoning "\\nplan…\\n", content "answer"
    plan…</think>answer                     same, when the prompt already opened <think>
    answer                                   content only (thinking off, or never started)
    <think>plan… (cut by max_tokens)         reasoning only

Streaming holds back only what may be the start of a tag, so a tag split across tokens never
leaks into either field.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def uses_reasoning(chat_template: str | None) -> bool:
    """Whether a model thinks in <think> blocks, from its chat template."""
    return bool(chat_template) and END in chat_template  # type: ignore[operator]


class ReasoningParser:
    """One sample's text, fed as it streams, split into (reasoning, content) deltas."""

    def __init__(self, in_reasoning: bool = False) -> None:
        # in_reasoning: the prompt ends inside an open <think> (the template opened it).
        self.state = "reasoning" if in_reasoning else "start"
        self.thought = in_reasoning  # a reasoning part exists (possibly empty)
        self.buf = ""  # text received but not yet given out
        self.content_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf, self.state = head[len(START):], "reasoning"
                    self.thought = True
                    continue
                if not head or START.startswith(head):
                    break  # may still become <think>
                self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(END):], "content"
                    continue
                keep = partial_tag_len(self.buf, END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                if not self.content_started:
                    self.buf = self.buf.lstrip("\n")  # the blank line after </think>
                    if not self.buf:
                        break
                    self.content_started = True
                content += self.buf
                self.buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held: a partial tag is text after all."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest if self.content_started or self.state == "start" else rest.lstrip("\n")


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None when there was none, content) of a whole output."""
    p = ReasoningParser(in_reasoning)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.thought else None), c1 + c2


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
