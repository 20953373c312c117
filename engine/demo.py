"""`tandem-demo`: a tiny random Llama with a byte-level tokenizer, built deterministically on
first use so the whole stack runs without a model hub. Its text is noise; the pipeline is real.

The checkpoint is an ordinary Hugging Face directory (transformers' AutoModelForCausalLM and
AutoTokenizer load it), so the engine loads it through the same path as a real model:

    <cache>/tandem-demo-v1/
        config.json             LlamaForCausalLM, as transformers 5.24 save_pretrained writes it
        generation_config.json
        model.safetensors       float32, Hugging Face Llama tensor names
        tokenizer.json          byte-level: token id b < 256 is byte b; specials from 256
        tokenizer_config.json   Llama-3-style chat template

Token ids:

    0 ..... 255   the 256 bytes (id == byte value)
    256 .......   <|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> <|eot_id|>
    261 ... 319   <|reserved_special_token_N|>, padding the vocabulary to a multiple of 64 (as
                  Llama 3 does) so every row of the embedding decodes to a known token
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bump when anything below changes what is written: a cached directory is never rebuilt.
DEMO_VERSION = 1
DEMO_NAME = "tandem-demo"
SEED = 1234

NUM_BYTES = 256
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>")
BOS_ID = NUM_BYTES  # <|begin_of_text|>
END_OF_TEXT_ID = NUM_BYTES + 1
EOT_ID = NUM_BYTES + 4
VOCAB_SIZE = 320  # 256 + 5 specials, padded up to a multiple of 64
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 768
MAX_POSITIONS = 2048

# Llama 3 Instruct's template, minus its tool and date handling.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Written as literals, not through transformers, so the bytes do not depend on the installed
# transformers version (the GPU image ships an older one). Matches what transformers 5.24's
# LlamaForCausalLM(config).save_pretrained writes; tests/unit/test_demo.py checks that.
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": BOS_ID,
    "dtype": "float32",
    "eos_token_id": [END_OF_TEXT_ID, EOT_ID],
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": MAX_POSITIONS,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "transformers_version": "5.24.0",
    "use_cache": True,
    "vocab_size": VOCAB_SIZE,
}

GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": BOS_ID,
    "eos_token_id": [END_OF_TEXT_ID, EOT_ID],
    "transformers_version": "5.24.0",
}

TOKENIZER_CONFIG: dict[str, Any] = {
    # The generic fast tokenizer: it loads tokenizer.json as written. A model-specific class
    # (LlamaTokenizerFast) would impose its own pre-tokenizer on load in transformers 5.
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|eot_id|>",
    "clean_up_tokenization_spaces": False,
    "model_max_length": MAX_POSITIONS,
    "chat_template": CHAT_TEMPLATE,
}


def cache_root() -> Path:
    """$TANDEM_CACHE_DIR, default ~/.cache/tandem."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def demo_model_dir() -> Path:
    """The demo checkpoint directory, built on first use."""
    return cached_dir(cache_root() / f"{DEMO_NAME}-v{DEMO_VERSION}", build_demo_checkpoint)


def cached_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, built by `build(dir)` on first use (done once config.json exists).

    Safe under concurrent first use by several processes: each builds into its own temporary
    directory next to the target and renames it into place; rename is atomic, so a reader sees
    either no directory or a complete one, and a loser of the race discards its copy."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy first (the target exists and is not empty).
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_demo_checkpoint(out_dir: str | Path) -> None:
    """Write the demo checkpoint into `out_dir` (which must exist). Deterministic: the same
    bytes every time, for a given torch and tokenizers version."""
    out = Path(out_dir)
    _write_json(out / "config.json", CONFIG)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    _write_json(out / "tokenizer_config.json", TOKENIZER_CONFIG)
    _build_tokenizer().save(str(out / "tokenizer.json"))
    _write_weights(out / "model.safetensors")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet the ByteLevel pre-tokenizer and
    decoder use: printable bytes map to themselves, the rest to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _build_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415 - only when building

    to_char = _byte_to_unicode()
    # BPE with no merges: every byte is its own token, and token id == byte value.
    vocab = {to_char[b]: b for b in range(NUM_BYTES)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: without merges it would not change the tokens, only cost time.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_special_token_{i}|>"
                for i in range(VOCAB_SIZE - NUM_BYTES - len(SPECIAL_TOKENS))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in (*SPECIAL_TOKENS, *reserved)])
    # encode(add_special_tokens=True) prepends BOS, as Llama 3's tokenizer does.
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)])
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def _weight_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor, in generation order (the order the seeded generator is drawn in)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB_SIZE, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.self_attn.q_proj.weight", (q, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (kv, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, q)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB_SIZE, HIDDEN))]
    return shapes


def _write_weights(path: Path) -> None:
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    g = torch.Generator(device="cpu").manual_seed(SEED)
    tensors = {}
    for name, shape in _weight_shapes():
        if len(shape) == 1:  # RMSNorm weights
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=g, dtype=torch.float32) * 0.05
    save_file(tensors, str(path), metadata={"format": "pt"})
