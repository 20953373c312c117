"""Tokenizer: encode/decode, chat templates, EOS ids, per-token text, on the demo's byte-level
tokenizer and on two tokenizers trained here with `tokenizers` (no hub):

- a SentencePiece-style BPE as Llama 2 / Mistral ship it: "▁" for spaces, byte fallback
  (<0xNN> tokens), a decoder that strips the first leading space;
- a byte-level BPE with merges as GPT-2 / Qwen ship it, so one token can hold part of a
  UTF-8 character.

The tokenizers are built in tests/tiny_tokenizers.py; the fixtures live in tests/unit/conftest.py.
"""

from __future__ import annotations

import json

import pytest

from tandem.engine.demo import BOS_ID, END_OF_TEXT_ID, EOT_ID
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import InvalidArgument, ModelLoadError
from tiny_tokenizers import build_bytelevel_bpe_tokenizer, build_sentencepiece_tokenizer

TEXTS = ["hello world", " leading space", "naïve café", "日本語", "😀👍🏽🇫🇷", "a\n\tb  c", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(demo, sp, bpe, text):
    for tok in (demo, sp, bpe):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_laid_end_to_end_are_the_text(demo, sp, bpe, text):
    """logprobs' `bytes`: a token that holds part of a character (a byte-fallback <0xF0>, a
    byte-level token) gives its own bytes, not those of U+FFFD."""
    for tok in (demo, sp, bpe):
        ids = tok.encode(text, add_special_tokens=False)
        got = b"".join(tok.token_bytes(i) for i in ids)
        # SentencePiece writes the first word's space that a lone decode strips.
        assert got.decode() in (text, " " + text), (tok.model_dir, text)
    emoji = demo.encode("😀", add_special_tokens=False)
    assert [demo.token_bytes(i) for i in emoji] == [b"\xf0", b"\x9f", b"\x98", b"\x80"]


def test_demo_ids_are_bytes_and_bos_is_added(demo):
    assert demo.encode("hé", add_special_tokens=False) == [ord("h"), 0xC3, 0xA9]
    assert demo.encode("hé") == [BOS_ID, ord("h"), 0xC3, 0xA9]
    assert demo.bos_token_id == BOS_ID
    assert demo.vocab_size == 320


def test_skip_special_tokens(demo):
    ids = [BOS_ID, ord("a"), EOT_ID]
    assert demo.decode(ids) == "a"
    assert demo.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>a<|eot_id|>"


def test_incomplete_utf8_decodes_to_replacement(demo):
    euro = "€".encode()
    assert demo.decode(list(b"a" + euro[:2])) == "a\ufffd"
    assert demo.decode(list(b"a" + euro)) == "a€"


def test_decode_does_not_clean_up_spaces(bpe):
    # transformers' clean_up_tokenization_spaces would turn this into "a. b, c!"
    text = "a . b , c !"
    assert bpe.decode(bpe.encode(text)) == text


def test_eos_token_ids(demo, sp, bpe, tmp_path):
    # demo: the tokenizer's <|eot_id|>, then generation_config.json's list, deduplicated.
    assert demo.eos_token_ids == (EOT_ID, END_OF_TEXT_ID)
    assert sp.eos_token_ids == (2,)  # </s>, no config files
    assert bpe.eos_token_ids == (bpe.encode("<|im_end|>")[0],)
    d = build_bytelevel_bpe_tokenizer(tmp_path / "ckpt")
    (d / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer(d).eos_token_ids == (2, 7)
    # generation_config.json takes precedence over config.json, as in transformers' generate.
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Tokenizer(d).eos_token_ids == (2, 0)


def test_token_text_keeps_the_space_a_lone_decode_strips(sp):
    [tid] = [i for i in sp.encode("the quick", add_special_tokens=False)
             if sp.convert_ids_to_tokens([i])[0].startswith("▁")][:1]
    assert sp.decode([tid]) == sp.token_text(tid).lstrip(" ")
    assert sp.token_text(tid).startswith(" ")
    assert sp.token_text(sp.encode("<s>", add_special_tokens=False)[0]) == "<s>"


def test_token_text_and_tokens(demo, bpe):
    assert demo.token_text(ord(" ")) == " "
    assert demo.token_text(0xE2) == "\ufffd"  # first byte of a 3-byte character
    assert demo.token_text(EOT_ID) == "<|eot_id|>"
    assert demo.convert_ids_to_tokens([ord(" "), ord("a"), EOT_ID, 10_000]) == \
        ["Ġ", "a", "<|eot_id|>", ""]
    for tid in bpe.encode(" the quick brown fox", add_special_tokens=False):
        assert bpe.token_text(tid) == bpe.decode([tid])  # byte-level: no context needed


def test_chat_template_demo(demo):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "}]
    ids = demo.apply_chat_template(msgs)
    assert demo.decode(ids, skip_special_tokens=False) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = demo.apply_chat_template(msgs, add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)
    assert ids.count(BOS_ID) == 1  # the template's BOS only; encoding must not add another


def test_chat_template_chatml(bpe):
    ids = bpe.apply_chat_template([{"role": "user", "content": "hello"}])
    assert bpe.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("messages, needle", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "[0] must be an object"),
    ([{"content": "x"}], "[0].role is missing"),
    ([{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}], "[1].role 'bot'"),
    ([{"role": "user"}], "[0].content is missing"),
    ([{"role": "user", "content": None}], "[0].content is missing"),
    ([{"role": "user", "content": 3}], "[0].content must be a string"),
])
def test_malformed_messages(demo, messages, needle):
    with pytest.raises(InvalidArgument) as e:
        demo.apply_chat_template(messages)
    assert e.value.field == "messages" and needle in str(e.value)


def test_template_rejection_is_invalid_argument(sp):
    ok = sp.apply_chat_template([{"role": "user", "content": "hi"}])
    assert sp.decode(ok) == "[INST] hi [/INST]"
    with pytest.raises(InvalidArgument, match="must alternate") as e:
        sp.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.field == "messages"


def test_no_chat_template(tmp_path):
    tok = Tokenizer(build_sentencepiece_tokenizer(tmp_path / "plain"))
    assert not tok.has_chat_template
    with pytest.raises(InvalidArgument, match="no chat template") as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert e.value.field == "messages"


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load"):
        Tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError):
        Tokenizer(tmp_path)


QWEN_LIKE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
    "{% endif %}{%- for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}"
    "{% endif %}{% endfor %}{%- if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}{% endif %}")


def test_tools_tool_turns_and_template_kwargs(demo, tmp_path):
    """Tools reach the template; a tool call's JSON arguments are an object there; template
    kwargs (Qwen3's enable_thinking) are passed; the answer's reading follows the template."""
    from tandem.router_svc.chat_request import output_spec, template_messages

    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((demo.model_dir / f).read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg,
                                                                "chat_template": QWEN_LIKE}))
    tok = Tokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    msgs = template_messages([
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    ids = tok.apply_chat_template(msgs, tools=tools)
    assert tok.decode(ids) == ('<tools>get_time;</tools><|user|>time?<|assistant|><tool_call>'
                               'get_time {"zone": "utc"}</tool_call><|tool|>12:00<|assistant|>'
                               '<think>')
    spec = output_spec(tok, "Qwen3ForCausalLM", ids, "auto", None)
    assert spec.reasoning and spec.in_reasoning and spec.tool_family == "hermes"
    off = tok.apply_chat_template(msgs[:1], enable_thinking=False)
    assert tok.decode(off).endswith("<think></think>")
    assert not output_spec(tok, "Qwen3ForCausalLM", off, "none", None).in_reasoning
