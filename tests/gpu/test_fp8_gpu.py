"""FP8 on a GPU: the FP8 KV kernels at Llama-3.1-8B attention shapes in bfloat16 against their
references; the engine with --kv-cache-dtype fp8 close to bf16 KV (CUDA graphs and eager
alike); torch._scaled_mm linear layers against the fp32 reference math (row-wise scales, and
scales of 1 with the scales applied after the product), the weight-only FP8
kernel of small M (kernels/fp8_gemv.py) at the 8B projections' shapes, and the engine with
--quantization fp8 close to bf16, in large and in small (weight-only) steps (compute capability
>= 8.9: Ada, Hopper).

Run on a CUDA box:  pytest -m gpu tests/gpu/test_fp8_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch
from gpu_kernels import BF16, DEV, ON_GPU, rel_err

pytestmark = ON_GPU
needs_fp8_mma = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 matmuls need compute capability >= 8.9")

if torch.cuda.is_available():
    from tandem.engine.llm import LLM
    from tandem.engine.quantization import fp8
    from tandem.engine.quantization.fp8 import Fp8Linear, fp8_linear, linear_path, quantize_weight
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.scoring import build, compare, score
    from tandem.kernels import (
        fp8_gemv,
        fp8_gemv_ref,
        fp8_scale_product,
        paged_decode_attention,
        paged_decode_attention_ref,
        paged_prefill_attention,
        paged_prefill_attention_ref,
        quant_fp8,
        quant_fp8_ref,
        rotary_store_kv,
        rotary_store_kv_ref,
    )
    from tandem.kernels._common import FP8_DTYPE, quantize_fp8_ref

# -- kernels at 8B shapes ------------------------------------------------------------------------
def _fp8_pool(seq_lens, block_size=16, hkv=8, d=128):
    """A block-major FP8 pool (2 layers) with each sequence's context in scattered blocks of
    layer 1, per-head scales, and the block tables."""
    per_seq = [-(s // -block_size) for s in seq_lens]
    n = sum(per_seq) + 4
    k_scale = torch.rand(hkv, device=DEV) * 0.02 + 0.01
    v_scale = torch.rand(hkv, device=DEV) * 0.02 + 0.01
    pool = torch.empty(n, 2, 2, block_size, hkv, d, dtype=FP8_DTYPE, device=DEV)
    x = torch.randn(n, 2, 2, block_size, hkv, d, device=DEV)
    pool[:, :, 0], pool[:, :, 1] = (quantize_fp8_ref(x[:, :, 0], k_scale),
                                    quantize_fp8_ref(x[:, :, 1], v_scale))
    perm = torch.randperm(n, device=DEV).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=DEV)
    used = 0
    for b, m in enumerate(per_seq):
        tables[b, :m] = perm[used:used + m]
        used += m
    return pool, tables, k_scale, v_scale


@pytest.mark.parametrize("seq_lens", [[1], [4096], [17, 1000, 3000, 64] * 16],
                         ids=["b1-short", "b1-4k", "b64-mixed"])
def test_fp8_decode_attention_8b_shapes(seed, seq_lens):
    pool, tables, ks, vs = _fp8_pool(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(seq_lens), 32, 128, dtype=BF16, device=DEV)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    out = paged_decode_attention(q, kc, vc, tables, lens, 128 ** -0.5, k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 128 ** -0.5, ks, vs)
    assert rel_err(out, ref) < 1e-2, f"seed={seed}"


def test_fp8_prefill_attention_8b_shapes(seed):
    qlens, cached = [300, 1, 77, 512], [0, 700, 129, 1024]
    seq_lens = [q + c for q, c in zip(qlens, cached, strict=True)]
    pool, tables, ks, vs = _fp8_pool(seq_lens)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                       device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(qlens), 32, 128, dtype=BF16, device=DEV)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    out = paged_prefill_attention(q, kc, vc, qsl, lens, tables, 128 ** -0.5, max(qlens),
                                  k_scale=ks, v_scale=vs)
    ref = paged_prefill_attention_ref(q, kc, vc, qsl, lens, tables, 128 ** -0.5,
                                      k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < 1e-2, f"seed={seed}"


def test_fp8_rotary_store_kv_8b_shapes(seed):
    t, hq, hkv, d, bs = 300, 32, 8, 128, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=BF16, device=DEV)
    qkv_ref = qkv.clone()
    pos = torch.randint(0, 4000, (t,), device=DEV)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    slots = torch.randperm(64 * bs, device=DEV)[:t]
    ks, vs = torch.rand(hkv, device=DEV) * 0.02 + 0.01, torch.rand(hkv, device=DEV) * 0.02 + 0.01
    pools = [torch.zeros(64, 2, 2, bs, hkv, d, dtype=FP8_DTYPE, device=DEV) for _ in range(2)]
    for x, pool, fn in ((qkv, pools[0], rotary_store_kv), (qkv_ref, pools[1], rotary_store_kv_ref)):
        h = x.view(t, -1, d)
        fn(pos, h[:, :hq], h[:, hq:hq + hkv], h[:, hq + hkv:], cos_sin, pool[:, 0, 0],
           pool[:, 0, 1], slots, ks, vs)
    a, b = (p.view(torch.uint8) for p in pools)
    # The rotation's fp32 arithmetic may differ by an ulp, moving a rare element one e4m3 step.
    assert (a != b).float().mean().item() < 1e-3, f"seed={seed}"
    assert rel_err(pools[0].float(), pools[1].float()) < 1e-2, f"seed={seed}"


def test_quant_fp8_kernel_matches_reference(seed):
    x = torch.randn(333, 4096, dtype=BF16, device=DEV) * 3
    q, s = quant_fp8(x)
    q_ref, s_ref = quant_fp8_ref(x)
    assert torch.equal(s, s_ref), f"seed={seed}"
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"seed={seed}"


# -- torch._scaled_mm linear ---------------------------------------------------------------------
@needs_fp8_mma
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static-input"])
def test_scaled_mm_linear_matches_reference_math(seed, m, static):
    """fp8_linear against the same math in fp32; up to fp8.SCALES_AFTER_MAX_OUTPUT output
    elements it applies the scales and the bias after the product."""
    k, n = 4096, 6144
    w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
    wq, ws = quantize_weight(w)
    bias = torch.randn(n, device=DEV, dtype=BF16)
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    in_scale = torch.tensor([x.abs().max().item() / 448], device=DEV) if static else None
    out = fp8_linear(x, wq, ws, bias, in_scale)
    # The same math in fp32 on the CPU: W8A8 (the reference path) for torch._scaled_mm; the
    # weight-only kernel of small M leaves x in bf16 (and ignores the static input scale).
    if linear_path(m, True) == "gemv":
        ref = fp8_gemv_ref(x.cpu().float(), wq.cpu(), ws.cpu(), bias.cpu()).to(BF16)
    else:
        ref = fp8_linear(x.cpu(), wq.cpu(), ws.cpu(), bias.cpu(), None if in_scale is None
                         else in_scale.cpu())
    assert out.dtype == BF16 and out.shape == (m, n)
    assert rel_err(out.cpu(), ref) < 1e-2, f"seed={seed}"
    assert rel_err(out, x @ w.t() + bias) < 6e-2, f"seed={seed}"  # against unquantized bf16


# Llama-3.1-8B's projections (N, K): qkv, o, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@needs_fp8_mma
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize(("n", "k"), SHAPES_8B, ids=["qkv", "o", "gate_up", "down"])
def test_fp8_gemv_8b_shapes(seed, m, n, k):
    wq, ws = quantize_weight(torch.randn(n, k, device=DEV, dtype=BF16) * 0.02)
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    bias = torch.randn(n, device=DEV, dtype=BF16) if n == 6144 else None  # qwen2's qkv bias
    out = fp8_gemv(x, wq, ws, bias)
    ref = fp8_gemv_ref(x, wq, ws, bias)
    # The same fp32 sums in another order, rounded once to bf16 (2^-9 relative on average).
    assert rel_err(out, ref) < 4e-3, f"seed={seed}"
    if linear_path(m, True) == "gemv":  # fp8_linear dispatches to the kernel (m <= GEMV_MAX_M)
        assert torch.equal(fp8_linear(x, wq, ws, bias, None), out)
    if n * k <= 6144 * 4096:  # fp32 x (tl.dot in IEEE fp32) against fp32 math on the CPU
        x32 = x.float()
        ref32 = fp8_gemv_ref(x32.cpu(), wq.cpu(), ws.cpu())
        assert rel_err(fp8_gemv(x32, wq, ws).cpu(), ref32) < 1e-5, f"seed={seed}"


@needs_fp8_mma
@pytest.mark.parametrize("m", [2, 96, 256, 257])
@pytest.mark.parametrize(("n", "k"), SHAPES_8B, ids=["qkv", "o", "gate_up", "down"])
def test_scales_after_the_product_match_row_wise_scaled_mm(seed, m, n, k):
    """Few rows multiply with scales of 1 and scale after (fp8.scales_after): the same
    product as the row-wise _scaled_mm, and fp8_linear takes the path fp8.scales_after names."""
    wq, ws = quantize_weight(torch.randn(n, k, device=DEV, dtype=BF16) * 0.02)
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    xq, xs = quant_fp8(x)
    row = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=BF16,
                           use_fast_accum=fp8.FAST_ACCUM)
    one = torch.ones((), device=DEV)
    acc = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=fp8.ACC_DTYPE,
                           use_fast_accum=fp8.FAST_ACCUM)
    after = fp8_scale_product(acc, xs, ws, None, BF16)
    # Two kernels' fast accumulation in different orders: within the e4m3 operands' error.
    assert rel_err(after, row) < 1e-2, f"seed={seed}"
    assert torch.equal(fp8_linear(x, wq, ws, None, None),
                       after if fp8.scales_after(m, n) else row), f"seed={seed}"


@needs_fp8_mma
def test_fp8_linear_layer_captures_in_a_cuda_graph(seed):
    layer = Fp8Linear.from_float(torch.nn.Linear(1024, 2048, bias=False, device=DEV, dtype=BF16))
    x = torch.randn(8, 1024, device=DEV, dtype=BF16)
    eager = layer(x)
    graph = torch.cuda.CUDAGraph()
    layer(x)  # warm up (Triton compiles here)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager), f"seed={seed}"


# -- the engine ----------------------------------------------------------------------------------
TEXT = torch.randint(1, 512, (256,), generator=torch.Generator().manual_seed(0)).tolist()


def _score(model_dir, **kw):
    return score(build(str(model_dir), "cuda", "bfloat16", "auto", **kw), TEXT, 64, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_kv_close_to_bf16_kv(tiny_models, arch):
    """Bounds as the CPU test's (tests/e2e/test_fp8.py): fp8 KV against the model dtype's KV."""
    acc = compare(_score(tiny_models[arch]), _score(tiny_models[arch], kv_cache_dtype="fp8"),
                  TEXT)
    assert acc.mean_abs_dlogprob < 0.3 and acc.top1_agreement >= 0.65, acc


@needs_fp8_mma
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases, tied embeddings
def test_fp8_weights_close_to_bf16(tiny_models, arch):
    acc = compare(_score(tiny_models[arch]), _score(tiny_models[arch], quantization="fp8"), TEXT)
    assert acc.mean_abs_dlogprob < 0.5 and acc.top1_agreement >= 0.5, acc


@needs_fp8_mma
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_weights_small_steps_close_to_bf16(tiny_models, arch):
    """Every step at most 16 tokens (chunks of 16, then 32 decodes): each FP8 projection runs
    the weight-only kernel; bounds as test_fp8_weights_close_to_bf16's."""
    def small(**kw):
        return score(build(str(tiny_models[arch]), "cuda", "bfloat16", "auto", **kw), TEXT,
                     16, 32)

    acc = compare(small(), small(quantization="fp8"), TEXT)
    assert acc.mean_abs_dlogprob < 0.5 and acc.top1_agreement >= 0.5, acc


@pytest.mark.parametrize("quant", [None, "fp8"], ids=["fp8-kv", "fp8-w+kv"])
def test_fp8_decode_graphs_match_eager(tiny_models, quant, monkeypatch):
    """Decode steps replayed from CUDA graphs give eager's tokens: exactly with FP8 KV in
    float32; with FP8 weights (bf16 only) at >= 90% of positions, since the graphs' split-KV
    sums in another order and a random model has near ties. The matmuls accumulate exactly
    here: with the fast accumulation (the default) a padded graph batch's GEMM tiles round
    differently enough to flip a random model's near ties; what that costs a real model is
    test_fp8_weights_close_to_bf16's and benchmarks/engine/fp8_accuracy.py's to bound."""
    if quant and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability >= 8.9")
    monkeypatch.setattr(fp8, "FAST_ACCUM", False)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 11 * i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for graphs in (True, False):
        llm = LLM(str(tiny_models["llama"]), progress=False, device="cuda",
                  dtype="bfloat16" if quant else "float32", num_blocks=256,
                  kv_cache_dtype="fp8", quantization=quant, cuda_graphs=graphs, max_num_seqs=16)
        assert (llm.engine.runner.graphs is not None) == graphs
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
    if quant is None:
        assert outs[0] == outs[1]
    else:
        same = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y))
        assert same >= 0.9 * 8 * 24, outs
