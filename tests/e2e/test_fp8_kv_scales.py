"""Calibrated KV-cache scales from a checkpoint (engine/quantization/kv_cache.py): the tiny Llama
(2 layers, 2 KV heads) with k/v scale tensors written into its safetensors, under each common
spelling. With --kv-cache-dtype fp8 they become the engine's KVScales and serve exactly as the
same scales set by hand; under tensor parallelism each rank takes its heads' scales; bad or
partial scales are errors naming the tensor; with --kv-cache-dtype auto they are ignored."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engine.config import ModelConfig
from tandem.engine.llm import LLM
from tandem.engine.loader import build_model, load_weights
from tandem.engine.parallel import TPState, rank_heads
from tandem.engine.quantization.kv_cache import CheckpointKVScales, KVScales
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scoring import build, score
from tandem.errors import ModelLoadError

# [layer, KV head]. Head 1 of layer 0 and head 0 of layer 1 clamp (their K values reach ~6.7,
# past 448 * scale), so these scales change the model's output: a run that dropped them, or
# gave a rank another head's, would not match.
K = torch.tensor([[0.021, 0.004], [0.003, 0.037]])
V = torch.tensor([[0.043, 0.024], [0.031, 0.005]])
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(5 + 9 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PRE = "model.layers.{}.self_attn."


@pytest.fixture(scope="module")
def text() -> list[int]:
    return torch.randint(1, 512, (64,), generator=torch.Generator().manual_seed(1)).tolist()


def with_scales(src, dst, extra: dict[str, torch.Tensor]):
    """A copy of checkpoint `src` with the tensors `extra` added to its safetensors."""
    dst.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors.update(load_file(f))
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    save_file({**tensors, **extra}, dst / "model.safetensors")
    return dst


def spelled(form: str, k: torch.Tensor = K, v: torch.Tensor = V) -> dict[str, torch.Tensor]:
    """The scales [layer, head] as a checkpoint of `form` writes them."""
    out = {}
    for layer in range(k.shape[0]):
        pre = PRE.format(layer)
        if form == "per-head":
            out |= {pre + "k_scale": k[layer], pre + "v_scale": v[layer]}
        elif form == "scalar":
            out |= {pre + "k_scale": k[layer, 0].reshape(()),
                    pre + "v_scale": v[layer, 0].reshape(())}
        elif form == "kv_scale":
            out |= {pre + "kv_scale": k[layer, 0].reshape(())}
        elif form == "output_scale":  # compressed-tensors: [1] per tensor
            out |= {pre + "k_proj.output_scale": k[layer, :1],
                    pre + "v_proj.output_scale": v[layer, :1]}
        elif form == "output_scale-per-head":  # compressed-tensors attn_head: [heads, 1, 1]
            out |= {pre + "k_proj.output_scale": k[layer].reshape(-1, 1, 1),
                    pre + "v_proj.output_scale": v[layer].reshape(-1, 1, 1)}
        elif form == "modelopt":
            out |= {pre + "k_proj.k_scale": k[layer, :1], pre + "v_proj.v_scale": v[layer, :1]}
        elif form == "bf16":  # stored in another dtype than fp32
            out |= {pre + "k_scale": k[layer].bfloat16(), pre + "v_scale": v[layer].bfloat16()}
    return out


def expected(form: str) -> tuple[torch.Tensor, torch.Tensor]:
    if form in ("per-head", "output_scale-per-head"):
        return K, V
    if form == "bf16":
        return K.bfloat16().float(), V.bfloat16().float()
    k = K[:, :1].expand(-1, 2)
    return k, (k if form == "kv_scale" else V[:, :1].expand(-1, 2))


FORMS = ["per-head", "scalar", "kv_scale", "output_scale", "output_scale-per-head", "modelopt",
         "bf16"]


@pytest.mark.parametrize("form", FORMS)
def test_checkpoint_scales_become_the_engines(tiny_models, tmp_path, form):
    ckpt = with_scales(tiny_models["llama"], tmp_path / form, spelled(form))
    scales = build(str(ckpt), "cpu", "float32", "auto", kv_cache_dtype="fp8").runner.kv_scales
    k, v = expected(form)
    torch.testing.assert_close(scales.k, k, rtol=0, atol=0)
    torch.testing.assert_close(scales.v, v, rtol=0, atol=0)


def test_checkpoint_scales_serve_as_scales_set_by_hand(tiny_models, tmp_path, text):
    """Per-head scales from the checkpoint: the same log-probabilities (exactly) and greedy
    tokens as the plain checkpoint with the scales set by hand, and not those of 1.0."""
    plain = tiny_models["llama"]
    ckpt = with_scales(plain, tmp_path / "scaled", spelled("per-head"))
    from_ckpt = score(build(str(ckpt), "cpu", "float32", "auto", kv_cache_dtype="fp8"), text,
                      16, 8)
    by_hand = build(str(plain), "cpu", "float32", "auto", kv_cache_dtype="fp8")
    by_hand.runner.kv_scales.set(K, V)
    torch.testing.assert_close(from_ckpt, score(by_hand, text, 16, 8), rtol=0, atol=0)
    ones = score(build(str(plain), "cpu", "float32", "auto", kv_cache_dtype="fp8"), text, 16, 8)
    assert (from_ckpt - ones).abs().max() > 0.1

    llm = LLM(str(ckpt), progress=False, kv_cache_dtype="fp8")
    hand = LLM(str(plain), progress=False, kv_cache_dtype="fp8")
    hand.engine.runner.kv_scales.set(K, V)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
        [o.outputs[0].token_ids for o in hand.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_rank_loads_its_heads_scales(tiny_models, tmp_path, rank):
    """A TP 2 shard's load fills the KV scales of its own head (rank_heads) only."""
    ckpt = with_scales(tiny_models["llama"], tmp_path / "scaled", spelled("per-head"))
    cfg = ModelConfig.from_dir(ckpt)
    model = build_model(cfg, torch.float32, torch.device("cpu"), TPState(rank, 2))
    heads = rank_heads(cfg.num_kv_heads, 2, rank)
    assert heads == range(rank, rank + 1)
    target = KVScales.ones(cfg.num_layers, len(heads), torch.device("cpu"))
    load_weights(model, ckpt, progress=False,
                 kv_scales=CheckpointKVScales(target, cfg.num_layers, cfg.num_kv_heads, heads))
    assert torch.equal(target.k, K[:, rank:rank + 1]) and torch.equal(target.v, V[:, rank:rank + 1])


@pytest.mark.parametrize(("tp", "rank", "head"), [(4, 0, 0), (4, 1, 0), (4, 2, 1), (4, 3, 1)])
def test_ranks_beyond_the_kv_heads_take_their_replicated_heads_scales(tp, rank, head):
    target = KVScales.ones(2, 1, torch.device("cpu"))
    reader = CheckpointKVScales(target, 2, 2, rank_heads(2, tp, rank))
    for name, t in spelled("per-head").items():
        assert reader.take(name, lambda t=t: t, "model.safetensors")
    reader.finish("ckpt")
    assert torch.equal(target.k, K[:, head:head + 1]) and torch.equal(target.v, V[:, head:head + 1])


def test_tp2_with_checkpoint_scales_equals_tp1(tiny_models, tmp_path):
    """Over gloo on the CPU: each rank serves with its head's checkpoint scales, so TP 2 gives
    TP 1's greedy tokens (with these clamping scales, a rank holding another head's would
    not)."""
    ckpt = with_scales(tiny_models["llama"], tmp_path / "scaled", spelled("per-head"))

    def greedy(**kw) -> list[list[int]]:
        with LLM(str(ckpt), progress=False, kv_cache_dtype="fp8", **kw) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]

    assert greedy(tensor_parallel_size=2) == greedy()


@pytest.mark.parametrize(("name", "value"), [
    ("model.layers.1.self_attn.v_scale", torch.tensor(-0.02)),
    ("model.layers.0.self_attn.k_scale", torch.tensor([0.02, float("nan")])),
    ("model.layers.1.self_attn.k_scale", torch.tensor(float("inf"))),
    ("model.layers.0.self_attn.v_scale", torch.tensor(0.0)),
])
def test_a_bad_scale_fails_naming_the_tensor(tiny_models, tmp_path, name, value):
    ckpt = with_scales(tiny_models["llama"], tmp_path / "bad", {**spelled("per-head"), name: value})
    with pytest.raises(ModelLoadError, match=rf"{name} in model\.safetensors .*finite and positive"):
        LLM(str(ckpt), progress=False, kv_cache_dtype="fp8")


def _without_layer1_v(scales: dict) -> dict:
    return {k: v for k, v in scales.items() if k != "model.layers.1.self_attn.v_scale"}


@pytest.mark.parametrize(("case", "change", "error"), [
    ("partial", _without_layer1_v, r"missing: model\.layers\.1\.self_attn\.v_scale$"),
    ("wide", lambda s: {**s, "model.layers.0.self_attn.k_scale": torch.ones(3)},
     r"layers\.0\.self_attn\.k_scale .* 3 elements"),
    ("both", lambda s: {**s, "model.layers.0.self_attn.kv_scale": torch.tensor(0.1)},
     r"given twice.*kv_scale|kv_scale.*given twice"),
    ("beyond", lambda s: {**s, "model.layers.2.self_attn.k_scale": torch.tensor(0.1)},
     r"layers\.2\.self_attn\.k_scale .*has no place"),
])
def test_partial_or_misshapen_scales_are_named(tiny_models, tmp_path, case, change, error):
    ckpt = with_scales(tiny_models["llama"], tmp_path / case, change(spelled("per-head")))
    with pytest.raises(ModelLoadError, match=error):
        LLM(str(ckpt), progress=False, kv_cache_dtype="fp8")


def test_auto_cache_ignores_the_scales(tiny_models, tmp_path, caplog):
    """Without an FP8 cache the scales are read, logged once and ignored: the output equals
    the checkpoint's without them."""
    plain = tiny_models["llama"]
    ckpt = with_scales(plain, tmp_path / "scaled", spelled("per-head"))
    with caplog.at_level(logging.INFO, logger="tandem.engine.quantization.kv_cache"):
        llm = LLM(str(ckpt), progress=False)
    notes = [r.getMessage() for r in caplog.records if r.name == "tandem.engine.quantization.kv_cache"]
    assert len(notes) == 1 and "ignored" in notes[0] and "4 tensors" in notes[0], notes
    assert llm.engine.runner.kv_scales is None
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
        [o.outputs[0].token_ids for o in LLM(str(plain), progress=False).generate(PROMPTS,
                                                                                   GREEDY)]
