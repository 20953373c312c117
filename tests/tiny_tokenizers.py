"""Tokenizers trained here with `tokenizers` (no hub), beside the demo's byte-level one:

- a SentencePiece-style BPE as Llama 2 / Mistral ship it: "▁" for spaces, byte fallback
  (<0xNN> tokens), a decoder that strips the first leading space;
- a byte-level BPE with merges as GPT-2 / Qwen ship it, so one token can hold part of a
  UTF-8 character.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

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
