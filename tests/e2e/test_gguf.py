"""GGUF checkpoints: tiny random models written as llama.cpp writes them (tests/tiny_gguf.py) load
with the right weights (each tensor the dequantized one, Q/K rows back in Hugging Face's order),
the right config (head dim, rotary scaling, tied embeddings) and the tokenizer and chat template
of their metadata, and generate transformers' greedy tokens when it loads the same file; what
cannot be served is named."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny_gguf import llama3_rope_freqs, write_gguf

from tandem.engine.config import ModelConfig, RopeScaling
from tandem.engine.gguf_checkpoint import llama3_rope_scaling, read_tensors
from tandem.engine.llm import LLM
from tandem.engine.model_source import resolve_model
from tandem.engine.models.layers import rope_inv_freq
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import ModelLoadError

Q = gguf.GGMLQuantizationType
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(3 + 6 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Checkpoint directories of these throwaway files go to a throwaway cache."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


def greedy(model: str) -> list[list[int]]:
    return [o.outputs[0].token_ids
            for o in LLM(model, progress=False).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("quant", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1])
def test_weights_are_the_dequantized_tensors_in_hugging_face_order(tiny_models, tmp_path,
                                                                   quant):
    path = write_gguf(tiny_models["llama"], tmp_path / "tiny.gguf", quant)
    loaded = dict(read_tensors(resolve_model(str(path)), torch.float32))
    original = load_file(str(tiny_models["llama"] / "model.safetensors"))
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        x = tensor.float().numpy()
        # Blocks run along a row, so quantizing commutes with llama.cpp's order of the rows.
        want = gguf.quants.dequantize(gguf.quants.quantize(x, quant), quant) if x.ndim == 2 else x
        assert torch.equal(loaded[name], torch.from_numpy(np.asarray(want))), name


@pytest.mark.parametrize("arch,quant,as_dir", [("llama", Q.Q8_0, False), ("llama", Q.Q4_1, True),
                                               ("mistral", Q.Q4_0, False),
                                               ("qwen2", Q.Q8_0, False)])
def test_greedy_matches_transformers_on_the_same_file(tiny_models, tmp_path, arch, quant, as_dir):
    path = write_gguf(tiny_models[arch], tmp_path / f"tiny-{arch}.gguf", quant)
    ours = greedy(str(tmp_path if as_dir else path))  # a directory holding one GGUF file
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    for p, tokens in zip(PROMPTS, ours):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)
        assert tokens == ids[0, len(p):].tolist()


@pytest.mark.parametrize("arch", ["qwen3", "llama3", "llama-linear"])
def test_config_from_metadata_serves_the_original_checkpoint(tiny_models, tmp_path, arch):
    """What transformers' GGUF config misses: Qwen3's head dim (key_length, not hidden/heads),
    linear rotary scaling, and Llama 3.1 scaling stored as the rope_freqs tensor. Unquantized,
    the GGUF file must serve exactly what its original checkpoint does."""
    path = write_gguf(tiny_models[arch], tmp_path / f"tiny-{arch}.gguf", Q.F32)
    ours = ModelConfig.from_dir(resolve_model(str(path)))
    original = ModelConfig.from_dir(tiny_models[arch])
    assert dataclasses.replace(ours, rope_scaling=original.rope_scaling) == original
    assert ours.rope_scaling.rope_type == original.rope_scaling.rope_type
    torch.testing.assert_close(rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling),
                               rope_inv_freq(original.head_dim, original.rope_theta,
                                             original.rope_scaling), rtol=1e-6, atol=0)
    assert greedy(str(path)) == greedy(str(tiny_models[arch]))


def test_llama31_rotary_scaling_is_recovered_from_rope_freqs():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    divisors = llama3_rope_freqs(rope, 128, 500000.0).astype(np.float64)
    got = llama3_rope_scaling(divisors, 128, 500000.0)
    assert got["original_max_position_embeddings"] == 8192 and got["factor"] == 8.0
    assert got["high_freq_factor"] == pytest.approx(4.0, rel=1e-4)
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, RopeScaling(**got)),
                               rope_inv_freq(128, 500000.0, RopeScaling(**rope)))
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight is not Llama 3"):
        llama3_rope_scaling(np.linspace(1, 8, 64), 128, 500000.0)


def test_tokenizer_and_chat_template_come_from_the_metadata(tiny_models, tmp_path):
    path = write_gguf(tiny_models["llama"], tmp_path / "tiny.gguf", Q.Q8_0)
    ours, original = Tokenizer(resolve_model(str(path))), Tokenizer(tiny_models["llama"])
    text = "Hello, wörld! 1 + 1 = 2"
    assert ours.encode(text) == original.encode(text)
    assert ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    assert ours.apply_chat_template(chat) == original.apply_chat_template(chat)


def _minimal_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]]):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Q8_K: 256 values in 292 bytes a block; gguf has no dequantizer for it.
Q8K = {"blk.0.ffn_up.weight": (np.zeros((4, 292), np.uint8), Q.Q8_K)}
F32 = {"blk.0.ffn_up.weight": (np.zeros((4, 32), np.float32), Q.F32)}


@pytest.mark.parametrize("arch,tensors,message", [
    ("llama", Q8K, r"GGUF tensor blk\.0\.ffn_up\.weight is of type Q8_K, which gguf .* cannot"),
    ("gemma2", F32, r"GGUF architecture 'gemma2' \(general\.architecture\) is not supported"),
    ("llama", {"blk.0.attn_qkv.weight": (np.zeros((12, 32), np.float32), Q.F32)},
     r"GGUF tensor 'blk\.0\.attn_qkv\.weight' has no Hugging Face name"),
])
def test_what_cannot_be_served_is_named(tmp_path, arch, tensors, message):
    path = _minimal_gguf(tmp_path / "bad.gguf", arch, tensors)
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(str(path))


def test_unsupported_rotary_scaling_is_named(tiny_models, tmp_path):
    path = write_gguf(tiny_models["llama"], tmp_path / "yarn.gguf", Q.F32,
                      extra={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ModelLoadError, match=r"llama\.rope\.scaling\.type 'yarn'"):
        resolve_model(str(path))
