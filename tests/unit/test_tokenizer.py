"""Tokenizer: encode/decode, chat templates, EOS ids, per-token text, on the demo's byte-level
tokenizer and on two tokenizers trained here with `tokenizers` (no hub):

- a SentencePiece-style BPE as Llama 2 / Mistral ship it: "▁" for spaces, byte fallback
  (<0xNN> tokens), a decoder that strips the first leading space;
- a byte-level BPE with merges as GPT-2 / Qwen ship it, so one token can hold part of a
  UTF-8 character.

The builders are imported by test_detokenizer.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from engine.demo import BOS_ID, END_OF_TEXT_ID, EOT_ID, build_demo_checkpoint
from engine.errors import InvalidArgument, ModelLoadError
from engine.tokenizer import Tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there. Stop here: STOP!",
    "naïve café résumé über straße",
    "日本語のテキストと中文文本",
    "emoji 😀 party 🎉 thumbs 👍🏽 flags 🇫🇷",
    "def f(x):\n    return x + 1\n",
] * 4

# Mistral's template: it raises for roles that do not alternate.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _save(tok: HFTokenizer, path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return path


def build_sentencepiece_tokenizer(path: Path, chat_template: str | None = None) -> Path:
    """Llama-2-style: Prepend/Replace "▁" normalizer, BPE with byte fallback, decoder
    Replace + ByteFallback + Fuse + Strip(1 leading space); <s> prepended on encode."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=420, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    tok.train_from_iterator(CORPUS, trainer)
    # The trainer registers its special tokens as added tokens; byte tokens must be plain
    # vocabulary entries (the ByteFallback decoder reads them; skip_special_tokens must not).
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if not a["content"].startswith("<0x")]
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template:
        config["chat_template"] = chat_template
    return _save(HFTokenizer.from_str(json.dumps(spec)), path, config)


def build_bytelevel_bpe_tokenizer(path: Path) -> Path:
    """GPT-2 / Qwen-style: ByteLevel pre-tokenizer (regex split) and decoder, learned merges,
    ChatML specials and template, no BOS."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(CORPUS, trainer)
    return _save(tok, path, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                             "chat_template": CHATML_TEMPLATE})


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("demo")
    build_demo_checkpoint(d)
    return Tokenizer(d)


@pytest.fixture(scope="module")
def sp(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"),
                                                   MISTRAL_TEMPLATE))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_bytelevel_bpe_tokenizer(tmp_path_factory.mktemp("bpe")))


TEXTS = ["hello world", " leading space", "naïve café", "日本語", "😀👍🏽🇫🇷", "a\n\tb  c", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(demo, sp, bpe, text):
    for tok in (demo, sp, bpe):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


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
