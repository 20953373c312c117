"""GGUF checkpoints: tiny random models written as llama.cpp writes them load with the right
weights (Q/K rows back in Hugging Face's order, quantized tensors dequantized) and generate
transformers' greedy tokens when it loads the same file; a type that cannot be dequantized is
named."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny_gguf import write_gguf

from engine.errors import ModelLoadError
from engine.gguf_checkpoint import read_tensors
from engine.llm import LLM
from engine.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(3 + 6 * i)] for i in range(4)]


@pytest.mark.parametrize("arch,quant", [("llama", Q.Q8_0), ("llama", Q.Q4_1),
                                        ("qwen2", Q.Q8_0)])
def test_greedy_matches_transformers_on_the_same_file(tiny_models, tmp_path, arch, quant):
    path = write_gguf(tiny_models[arch], tmp_path / f"tiny-{arch}.gguf", quant)
    llm = LLM(str(path), progress=False)
    ours = [o.outputs[0].token_ids
            for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    for p, tokens in zip(PROMPTS, ours):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)
        assert tokens == ids[0, len(p):].tolist()
    # The directory form serves the same file, and text goes through its tokenizer.
    assert llm.tokenizer.decode(llm.tokenizer.encode("hello")) == "hello"


def test_unquantized_tensors_load_exactly(tiny_models, tmp_path):
    path = write_gguf(tiny_models["llama"], tmp_path / "tiny.gguf", Q.F32)
    original = load_file(str(tiny_models["llama"] / "model.safetensors"))
    loaded = dict(read_tensors(path, torch.float32))
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor.float()), name  # q/k rows unpermuted exactly


def test_a_type_that_cannot_be_dequantized_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "q8k.gguf"), "llama")
    w.add_head_count(4)
    w.add_head_count_kv(4)
    # Q8_K: 256 values in 292 bytes a block; gguf-py has no dequantizer for it.
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 292), dtype=np.uint8), raw_shape=(4, 292),
                 raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight is of type Q8_K"):
        list(read_tensors(tmp_path / "q8k.gguf", torch.float32))
