"""A tiny random Llama whose chat template does what real chat models' templates do, for the
OpenAI surface's tests: it opens a reasoning section in the prompt when asked (`thinking=True`,
as DeepSeek-R1's and Qwen3-Thinking's do), describes tools and tool turns in Hermes' syntax
(<tool_call>...</tool_call>), and its tokenizer has <think>, </think>, <tool_call> and
</tool_call> as tokens of their own (so a test can make the random model write them with
logit_bias)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

TEMPLATE = (
    "{# Reasoning: <think> ... </think> before the answer. #}"
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools: "
    "{{ tools | tojson }}. Call one as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>.<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}"
    "</tool_call>{% endfor %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if thinking %}<think>\n{% endif %}{% endif %}"
)


def build_surface_model(tiny_llama: Path, out: Path) -> Path:
    """`tiny_llama` (tests/tiny.py) with the tags above added to its tokenizer and TEMPLATE as
    its chat template."""
    shutil.copytree(tiny_llama, out)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok.save(str(out / "tokenizer.json"))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg.pop("added_tokens_decoder", None)  # tokenizer.json holds them all
    cfg_path.write_text(json.dumps(cfg))
    return out


def tag_ids(model_dir: Path) -> dict[str, int]:
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in TAGS}
