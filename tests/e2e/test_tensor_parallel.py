"""Tensor parallelism on the CPU (gloo): the offline engine at --tensor-parallel-size 2 gives the
same greedy tokens as at size 1 for tiny random checkpoints of every supported architecture,
with each rank holding only its shard of the weights and a KV pool of its own heads."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tandem.engine.config import ModelConfig
from tandem.engine.llm import LLM
from tandem.engine.loader import LazyTensor, build_model, load_weights
from tandem.engine.parallel import TPState, kv_head_start, kv_heads_per_rank, rank_heads
from tandem.engine.sampling_params import SamplingParams

NEW_TOKENS = 24
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(3 + 6 * i)] for i in range(6)]
PREFIX = [(11 * j) % 250 + 1 for j in range(40)]
SHARED = [PREFIX + [200 + i] * (1 + i) for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory):
    """A Llama with one KV head: at TP 2 both ranks hold (a replica of) it."""
    from tiny import COMMON

    out = tmp_path_factory.mktemp("mqa")
    config = transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 1})
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def greedy(path, prompts, **kwargs) -> list[list[int]]:
    """Greedy tokens of the offline engine; its pool idle after, its ranks stopped."""
    with LLM(str(path), progress=False, **kwargs) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert llm.engine.is_idle(), "KV pool not back to idle after generate"
        procs = llm.engine.tp_group.procs if llm.engine.tp_group else []
    assert all(p.returncode == 0 for p in procs), "a rank did not stop cleanly"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_tp2_greedy_equals_tp1(tiny_models, name):
    assert greedy(tiny_models[name], PROMPTS, tensor_parallel_size=2) == \
        greedy(tiny_models[name], PROMPTS)


def test_tp2_with_small_chunks_and_prefix_hits(tiny_models):
    """Chunked prefill and prefix-cache hits at TP 2: the same tokens as TP 1."""
    path = tiny_models["llama3"]
    kwargs = dict(max_num_batched_tokens=16, enable_prefix_caching=True)
    assert greedy(path, SHARED + PROMPTS, tensor_parallel_size=2, **kwargs) == \
        greedy(path, SHARED + PROMPTS, **kwargs)


def test_tp2_replicates_a_single_kv_head(mqa_model):
    assert greedy(mqa_model, PROMPTS[:3], tensor_parallel_size=2) == \
        greedy(mqa_model, PROMPTS[:3])


def test_tp_size_that_does_not_split_the_heads_is_refused(tiny_models):
    with pytest.raises(Exception, match="tensor_parallel_size"):
        LLM(str(tiny_models["llama"]), progress=False, tensor_parallel_size=3)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("rank", [0, 1])
def test_shard_holds_its_heads_and_reads_only_them(tiny_models, monkeypatch, name, rank):
    """Rank r's parameters are its slices of the checkpoint's tensors, and only replicated
    tensors (norms) are read whole from the file."""
    path = tiny_models[name]
    cfg = ModelConfig.from_dir(path)
    read_whole: list[tuple[int, ...]] = []
    full = LazyTensor.full
    monkeypatch.setattr(LazyTensor, "full",
                        lambda self: read_whole.append(tuple(self.shape)) or full(self))
    model = build_model(cfg, torch.float32, torch.device("cpu"), TPState(rank, 2))
    load_weights(model, path, progress=False)
    assert all(len(shape) == 1 for shape in read_whole), read_whole  # norms only

    hf = load_file(path / "model.safetensors")
    hd, hq = cfg.head_dim, cfg.num_heads // 2
    kv0, nkv = kv_head_start(cfg.num_kv_heads, 2, rank), kv_heads_per_rank(cfg.num_kv_heads, 2)
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([hq * hd, nkv * hd, nkv * hd])
    pre = "model.layers.1.self_attn."
    assert torch.equal(q, hf[pre + "q_proj.weight"][rank * hq * hd:(rank + 1) * hq * hd])
    assert torch.equal(k, hf[pre + "k_proj.weight"][kv0 * hd:(kv0 + nkv) * hd])
    assert torch.equal(v, hf[pre + "v_proj.weight"][kv0 * hd:(kv0 + nkv) * hd])
    assert torch.equal(attn.o_proj.weight,
                       hf[pre + "o_proj.weight"][:, rank * hq * hd:(rank + 1) * hq * hd])
    inter = cfg.intermediate_size // 2
    mlp = model.model.layers[1].mlp
    assert torch.equal(mlp.down_proj.weight, hf["model.layers.1.mlp.down_proj.weight"][
        :, rank * inter:(rank + 1) * inter])
    vocab = cfg.vocab_size // 2
    assert torch.equal(model.model.embed_tokens.weight,
                       hf["model.embed_tokens.weight"][rank * vocab:(rank + 1) * vocab])
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(("kv_heads", "tp", "expected"), [
    (8, 2, [range(0, 4), range(4, 8)]),
    (2, 2, [range(0, 1), range(1, 2)]),
    (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
    (1, 2, [range(0, 1), range(0, 1)]),
])
def test_kv_heads_per_rank(kv_heads, tp, expected):
    assert [rank_heads(kv_heads, tp, r) for r in range(tp)] == expected


def test_dummy_weights_of_a_shard_are_the_unsharded_models_slices(tiny_models):
    """--load-format dummy draws each tensor whole, so TP N computes what TP 1 does (the GPU
    benchmarks compare TP 2 with TP 1 on dummy weights)."""
    from tandem.engine.loader import init_dummy_weights

    cfg = ModelConfig.from_dir(tiny_models["qwen2"])
    whole = build_model(cfg, torch.float32, torch.device("cpu"))
    init_dummy_weights(whole, seed=3)
    shard = build_model(cfg, torch.float32, torch.device("cpu"), TPState(1, 2))
    init_dummy_weights(shard, seed=3)
    hd, hq = cfg.head_dim, cfg.num_heads // 2
    q_whole = whole.model.layers[0].self_attn.qkv_proj.weight[:cfg.num_heads * hd]
    q_shard = shard.model.layers[0].self_attn.qkv_proj.weight[:hq * hd]
    assert torch.equal(q_shard, q_whole[hq * hd:])
    bias_whole = whole.model.layers[0].self_attn.qkv_proj.bias[:cfg.num_heads * hd]
    assert torch.equal(shard.model.layers[0].self_attn.qkv_proj.bias[:hq * hd],
                       bias_whole[hq * hd:])
    inter = cfg.intermediate_size // 2
    assert torch.equal(shard.model.layers[1].mlp.down_proj.weight,
                       whole.model.layers[1].mlp.down_proj.weight[:, inter:])
