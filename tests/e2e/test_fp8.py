"""FP8 on the CPU, end to end through the engine: an FP8 KV cache stays close to the float32
model (bounds from measurement, with margin) and would not if dequantization were wrong; the
pool holds twice bf16's tokens in the same bytes; FP8 weights (quantized at load, or loaded
from FP8 checkpoints in both common formats) run the reference path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tandem.engine.attention.torch_backend as torch_backend
from tandem.engine.llm import LLM
from tandem.engine.models.layers import RMSNorm
from tandem.engine.quantization import fp8_fusion
from tandem.engine.quantization.fp8 import Fp8Linear, linear_path, quantize_weight
from tandem.engine.quantization.fp8_fusion import Fp8MLP, Fp8RMSNorm
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scoring import Accuracy, build, compare, score
from tandem.errors import InvalidArgument, ModelLoadError
from tandem.kernels._common import INTERPRET

# The tiny Llama (2 layers, 2 KV heads) over 128 fixed random tokens, teacher-forced: prefill
# chunks of 32 over the cached context, the last 16 tokens one a step (the decode path). Greedy
# agreement is top-1 agreement at each position (free-running greedy text from a random model
# diverges at the first near tie, FP8 or not). Measured, fp8 KV against float32 KV:
#   unit scales          mean |dlogprob| 0.136, top-1 agreement 85%
#   uneven scales        0.136, 80%
#   scale dropped        1.70, 0%       (a reader that forgets the scale)
MEAN_BOUND, TOP1_BOUND = 0.3, 0.65


@pytest.fixture(scope="module")
def text() -> list[int]:
    return torch.randint(1, 512, (128,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def baseline(tiny_models, text) -> torch.Tensor:
    return score(build(str(tiny_models["llama"]), "cpu", "float32", "auto"), text, 32, 16)


def _fp8_kv(tiny_models, text, scales=None) -> torch.Tensor:
    engine = build(str(tiny_models["llama"]), "cpu", "float32", "auto", kv_cache_dtype="fp8")
    assert engine.runner.pool.dtype == torch.float8_e4m3fn
    if scales is not None:
        engine.runner.kv_scales.set(*scales)
    return score(engine, text, 32, 16)


def _within_bounds(acc: Accuracy) -> bool:
    print(acc)
    return acc.mean_abs_dlogprob < MEAN_BOUND and acc.top1_agreement >= TOP1_BOUND


# Per-(layer, KV head) scales around the ones calibration gives this model (~0.015: amax 6.7).
UNEVEN = (torch.tensor([[0.021, 0.037], [0.052, 0.029]]),
          torch.tensor([[0.043, 0.024], [0.031, 0.058]]))


@pytest.mark.parametrize("scales", [None, UNEVEN], ids=["unit-scales", "uneven-scales"])
def test_fp8_kv_stays_close_to_float32(tiny_models, text, baseline, scales):
    assert _within_bounds(compare(baseline, _fp8_kv(tiny_models, text, scales), text))


def test_fp8_kv_bounds_catch_a_dropped_scale(tiny_models, text, baseline, monkeypatch):
    monkeypatch.setattr(torch_backend, "dequantize_kv", lambda x, scale, dtype: x.to(dtype))
    assert not _within_bounds(compare(baseline, _fp8_kv(tiny_models, text, UNEVEN), text))


def test_fp8_pool_holds_twice_the_tokens_of_bf16(tiny_models):
    budget = 1 << 20
    runners = {kv: LLM(str(tiny_models["llama"]), progress=False, dtype="bfloat16",
                       cpu_kv_bytes=budget, kv_cache_dtype=kv).engine.runner
               for kv in ("auto", "fp8")}
    assert runners["fp8"].block_bytes * 2 == runners["auto"].block_bytes
    assert runners["fp8"].num_blocks == 2 * runners["auto"].num_blocks
    assert runners["fp8"].num_blocks * runners["fp8"].block_bytes <= budget


def test_fp8_kv_serves_prefix_hits_and_forks(tiny_models):
    """Prefix-cache hits read FP8 blocks another request wrote; n > 1 copies a shared partial
    block on write: outputs equal a run without the cache."""
    prompt = [(7 * i) % 500 + 1 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(str(tiny_models["llama"]), progress=False, kv_cache_dtype="fp8",
                  enable_prefix_caching=caching)
        first = llm.generate([prompt], params)[0].outputs[0].token_ids
        again = llm.generate([prompt + first[:3]], params)[0]
        n3 = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8))
        outs[caching] = (first, again.outputs[0].token_ids, [o.token_ids for o in n3[0].outputs])
        assert llm.engine.is_idle()
        if caching:
            assert again.num_cached_tokens >= 32
    assert outs[True] == outs[False]


def test_kv_cache_dtype_is_validated(tiny_models):
    with pytest.raises(InvalidArgument, match="kv_cache_dtype"):
        LLM(str(tiny_models["llama"]), progress=False, kv_cache_dtype="int8")
    with pytest.raises(InvalidArgument, match="quantization"):
        LLM(str(tiny_models["llama"]), progress=False, quantization="int4")


# -- FP8 weights ---------------------------------------------------------------------------------
def test_quantize_weight_per_channel():
    w = torch.randn(6, 32) * torch.logspace(-2, 2, 6)[:, None]
    q, s = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6,)
    assert torch.all(q.float().abs().amax(1) == 448.0)  # each row's max maps to e4m3's max
    deq = q.float() * s[:, None]
    assert torch.all((deq - w).abs() <= w.abs() * 2**-4 + s[:, None] * 2**-10)


def _fp8_runner(model_dir, **kw):
    return build(str(model_dir), "cpu", "float32", "auto", **kw)


def test_quantize_at_load_swaps_the_projections_only(tiny_models, text, baseline):
    engine = _fp8_runner(tiny_models["llama"], quantization="fp8")
    model = engine.runner.model
    swapped = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert swapped == {f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert model.lm_head.weight.dtype == torch.float32
    # Measured: mean |dlogprob| 0.26, top-1 64% (per-channel weights, per-token activations,
    # every projection of a random model); the scale math itself is pinned by the checkpoint
    # tests below.
    acc = compare(baseline, score(engine, text, 32, 16), text)
    print(acc)
    assert acc.mean_abs_dlogprob < 0.5 and acc.top1_agreement >= 0.5, acc


def _fp8_checkpoint(src, dst, fmt: str):
    """The tiny checkpoint's projections in e4m3, saved as `fmt` would: "fp8" (per-tensor
    weight scales and static input scales) or "compressed-tensors" (per-channel scales,
    dynamic activations)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            if name.endswith("proj.weight"):
                base = name.removesuffix(".weight")
                if fmt == "fp8":
                    scale = t.abs().max() / 448
                    tensors[name] = (t / scale).to(torch.float8_e4m3fn)
                    tensors[f"{base}.weight_scale"] = scale.reshape(())
                    tensors[f"{base}.input_scale"] = torch.tensor(0.02)
                else:
                    q, s = quantize_weight(t)
                    tensors[name], tensors[f"{base}.weight_scale"] = q, s[:, None]
            else:
                tensors[name] = t
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "activation_scheme": "static"} if fmt == "fp8" else
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                   "dynamic": True}}}})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_compressed_tensors_checkpoint_equals_quantizing_at_load(tiny_models, tmp_path, text):
    """Per-channel e4m3 weights loaded from a checkpoint run exactly the math of the same
    quantization done at load."""
    ckpt = _fp8_checkpoint(tiny_models["llama"], tmp_path / "ct", "compressed-tensors")
    loaded = score(_fp8_runner(ckpt), text[:40], 32, 4)
    at_load = score(_fp8_runner(tiny_models["llama"], quantization="fp8"), text[:40], 32, 4)
    torch.testing.assert_close(loaded, at_load, rtol=0, atol=0)


def test_fp8_checkpoint_with_static_scales_loads(tiny_models, tmp_path, text, baseline):
    ckpt = _fp8_checkpoint(tiny_models["llama"], tmp_path / "fp8", "fp8")
    engine = _fp8_runner(ckpt)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv._input_scale.item() == pytest.approx(0.02)
    # q, k and v kept their own per-tensor scales: three runs of equal channel scales.
    sizes = list(qkv.shard_sizes.values())
    runs = torch.split(qkv.weight_scale, sizes)
    assert all(torch.all(r == r[0]) for r in runs) and len({r[0].item() for r in runs}) == 3
    acc = compare(baseline, score(engine, text, 32, 16), text)
    assert acc.mean_abs_dlogprob < 2 * MEAN_BOUND, acc  # per-tensor static: coarser


def test_unsupported_quantization_configs_are_named(tiny_models, tmp_path):
    for qc, match in [({"quant_method": "gptq"}, "gptq"),
                      ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise")]:
        d = tmp_path / qc["quant_method"]
        d.mkdir()
        for f in tiny_models["llama"].iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        with pytest.raises(ModelLoadError, match=match):
            _fp8_runner(d)


# -- the flags -----------------------------------------------------------------------------------
def test_generate_and_up_take_the_fp8_flags(tiny_models, capsys):
    from tandem.cli.main import build_parser, main
    from tandem.cli.up import stack_from_args

    assert main(["generate", "--model", str(tiny_models["llama"]), "--kv-cache-dtype", "fp8",
                 "--quantization", "fp8", "--prompt-token-ids", "5,6,7", "--max-tokens", "4",
                 "--temperature", "0", "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 4
    stack, _ = stack_from_args(build_parser("up").parse_args(
        ["up", "--device", "cpu", "--kv-cache-dtype", "fp8", "--quantization", "fp8"]))
    args = stack.worker_args
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert args[args.index("--quantization") + 1] == "fp8"


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on the CPU (TRITON_INTERPRET=1)")
def test_fused_activation_quantization_gives_the_unfused_logits(tiny_models, text, monkeypatch):
    """The norms and SiLU-and-mul in front of FP8 projections hand them e4m3 rows on the
    _scaled_mm path (engine/quantization/fp8_fusion.py). Taken here on the CPU, with the fused
    Triton kernels in the interpreter and the reference matmul: the prefill chunks (8 and 2
    rows) fuse, the decode steps (1 row, the weight-only kernel's on CUDA) do not, and the
    log-probabilities are those of the projections quantizing their own inputs."""
    engine = _fp8_runner(tiny_models["llama"], quantization="fp8")
    model = engine.runner.model
    fused_modules = {n for n, m in model.named_modules()
                     if isinstance(m, (Fp8RMSNorm, Fp8MLP))}
    assert fused_modules == {f"model.layers.{i}.{p}" for i in range(2) for p in (
        "input_layernorm", "post_attention_layernorm", "mlp")}
    assert type(model.model.norm) is RMSNorm  # in front of lm_head, which stays float
    unfused = score(engine, text[:12], 8, 2)  # on the CPU nothing fuses by default

    rows = []

    def on_the_cuda_rule(x: torch.Tensor) -> bool:
        rows.append(x.shape[0])
        return linear_path(x.shape[0], True) == "scaled_mm"

    monkeypatch.setattr(fp8_fusion, "fuses_quant", on_the_cuda_rule)
    fused = score(engine, text[:12], 8, 2)
    assert sorted(set(rows)) == [1, 2, 8]  # chunks of 8 and 2, then decodes
    # Measured: max |dlogprob| 4e-6 (the norm's fp32 sum and rsqrt against torch's, an ulp
    # apart); a dropped scale or residual moves them by whole units.
    torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-4)
