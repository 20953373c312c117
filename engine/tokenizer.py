"""The tokenizer of a checkpoint: a Hugging Face fast tokenizer loaded from local files, with the
checkpoint's own chat template.

Decoding goes straight to the `tokenizers` backend and never applies transformers'
`clean_up_tokenization_spaces` (which rewrites " ." to "." and so on): the streaming
detokenizer decodes through the same backend, so a streamed text and a one-shot decode agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.errors import InvalidArgument, ModelLoadError

# A model directory has a tokenizer when it holds one of these (dummy-weight benchmark configs
# come without: token ids only).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir: Path | None) -> bool:
    return model_dir is not None and any((model_dir / f).exists() for f in TOKENIZER_FILES)

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer:
    """Encode, decode and chat-template for one checkpoint directory."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is slow to import

        self.model_dir = Path(model_dir)
        try:
            hf = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        except Exception as e:  # missing or corrupt tokenizer files, unknown tokenizer class
            raise ModelLoadError(
                f"tokenizer: cannot load from {str(self.model_dir)!r}: {e!r}") from e
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ModelLoadError(f"tokenizer: {str(self.model_dir)!r} has no fast tokenizer "
                                 "(tokenizer.json); only fast tokenizers are supported")
        self.hf = hf
        self.backend = backend  # tokenizers.Tokenizer, used for decoding and streaming
        self.eos_token_ids: tuple[int, ...] = _eos_token_ids(self.model_dir, hf.eos_token_id)
        self.bos_token_id: int | None = hf.bos_token_id
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        # A byte-level vocabulary (GPT-2's, Llama 3's) spells each byte as one character.
        spec = json.loads(backend.to_str())
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        self._added = {a["id"] for a in spec.get("added_tokens") or ()}
        # A plain token to decode in front of another, see token_text().
        anchor = self.backend.encode("a", add_special_tokens=False).ids
        self._anchor: list[int] = anchor[-1:]

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included. A model's embedding may have more rows
        (padding): those ids decode to nothing."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary stands for (bounded above by its
        longest vocabulary string): a text longer than n times this has more than n tokens."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the checkpoint adds (usually BOS)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. An incomplete UTF-8 character at the end comes out as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of `ids` ("Ġthe", "▁the", "<0x0A>"); "" for an unknown id."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def token_text(self, token_id: int) -> str:
        """Decoded text of one token as it reads inside a text, for logprobs: "▁the" gives
        " the" (a lone decode would strip that space), a partial UTF-8 byte gives U+FFFD,
        a special token its own text. Cached."""
        text = self._token_text.get(token_id)
        if text is None:
            # Decoders strip a leading space from the first token only (SentencePiece), so
            # decode behind an anchor token and remove the anchor's text.
            anchor = self.backend.decode(self._anchor, skip_special_tokens=False)
            both = self.backend.decode([*self._anchor, token_id], skip_special_tokens=False)
            if self._anchor and both.startswith(anchor):
                text = both[len(anchor):]
            else:
                text = self.backend.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, for logprobs' `bytes`: a byte-fallback token
        (<0xF0>) or a byte-level token ("ð") is its byte or bytes, however little of a UTF-8
        character that is, so the tokens' bytes laid end to end are the text's. Cached."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            piece = self.backend.id_to_token(token_id) or ""
            if _BYTE_FALLBACK.fullmatch(piece):
                raw = bytes([int(piece[3:5], 16)])
            elif self._byte_level and token_id not in self._added and \
                    all(c in _UNICODE_TO_BYTE for c in piece):
                raw = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            else:
                raw = self.token_text(token_id).encode()
            self._token_bytes[token_id] = raw
        return raw

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation rendered with the checkpoint's own chat template.

        Each message is {"role": system|user|assistant|tool, "content": str} (extra keys, such
        as tool_calls and tool_call_id, are passed to the template). `tools`: OpenAI function
        tools, for templates that describe them; `template_kwargs`: template variables (e.g.
        Qwen3's enable_thinking). Raises InvalidArgument("messages", ...) for malformed
        messages, a checkpoint without a template, or a template that rejects the
        conversation (e.g. roles that do not alternate)."""
        if not self.has_chat_template:
            raise InvalidArgument("messages", f"model {self.model_dir.name!r} has no chat "
                                  "template; send a plain prompt instead")
        _validate_messages(messages)
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False, tools=tools,
                                              **template_kwargs)
        except Exception as e:  # jinja2 errors, including the template's own raise_exception
            raise InvalidArgument("messages", f"the chat template rejected them: {e}") from e
        return list(ids)


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map of byte-level vocabularies: printable bytes are their own
    character, the others shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument("messages", f"[{i}] must be an object with role and content")
        role = m.get("role")
        if role is None:
            raise InvalidArgument("messages", f"[{i}].role is missing")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise InvalidArgument("messages", f"[{i}].role {role!r} is not one of "
                                  f"{', '.join(sorted(CHAT_ROLES))}")
        if "content" not in m or m["content"] is None:
            raise InvalidArgument("messages", f"[{i}].content is missing")
        if not isinstance(m["content"], str):
            raise InvalidArgument("messages", f"[{i}].content must be a string")


def _eos_token_ids(model_dir: Path, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's EOS plus generation_config.json's (which is
    what transformers' generate uses; Llama 3 Instruct lists <|eot_id|> only there), or
    config.json's when there is no generation config."""
    ids: list[int] = [] if tokenizer_eos is None else [tokenizer_eos]
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(f"tokenizer: {path} is not a JSON object: {e!r}") from e
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
        break
    return tuple(dict.fromkeys(int(i) for i in ids))  # dedup, keep order
