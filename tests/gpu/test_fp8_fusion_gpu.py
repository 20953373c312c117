"""The fused activation quantization of FP8 weights on a GPU: the norm + FP8 and SiLU-and-mul +
FP8 kernels at Llama-3.1-8B shapes equal the unfused pairs (rms_norm or silu_and_mul, then
quant_fp8) they replace, and stay close to the torch references; the fused modules capture in a
CUDA graph; and the engine with --quantization fp8 gives the same log-probabilities with the
fusion as without it (compute capability >= 8.9 for the engine and the layers).

Run on a CUDA box:  pytest -m gpu tests/gpu/test_fp8_fusion_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch
from gpu_kernels import BF16, DEV, ON_GPU, capture, rel_err

pytestmark = ON_GPU
needs_fp8_mma = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="FP8 matmuls need compute capability >= 8.9")

if torch.cuda.is_available():
    import tandem.kernels as kernels
    from tandem.engine.models.layers import RMSNorm
    from tandem.engine.quantization import fp8_fusion
    from tandem.engine.quantization.fp8 import Fp8Activation, Fp8Linear
    from tandem.engine.quantization.fp8_fusion import Fp8RMSNorm
    from tandem.engine.scoring import build, compare, score
    from tandem.kernels import (
        quant_fp8,
        rms_norm,
        rms_norm_quant_fp8,
        rms_norm_quant_fp8_ref,
        silu_and_mul,
        silu_and_mul_quant_fp8,
        silu_and_mul_quant_fp8_ref,
    )

HIDDEN, INTER = 4096, 14336  # Llama-3.1-8B


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many e4m3 values apart a and b are (sign-magnitude bytes)."""
    def ordinal(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.uint8).to(torch.int32)
        mag = bits & 0x7F
        return torch.where(bits & 0x80 != 0, -mag, mag)

    return (ordinal(a) - ordinal(b)).abs()


def assert_equals_unfused(fused, unfused, seed) -> None:  # type: ignore[no-untyped-def]
    """The same arithmetic as the unfused pair: equal scales, each element within one e4m3
    step (and in practice equal)."""
    q, s = fused[0], fused[1]
    q_ref, s_ref = unfused
    assert torch.equal(s, s_ref), f"seed={seed}: {(s != s_ref).sum().item()} scales differ"
    steps = e4m3_steps(q, q_ref)
    assert steps.max().item() <= 1, f"seed={seed}"
    assert steps.float().mean().item() < 1e-4, f"seed={seed}"


def dequantized(r) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return r[0].float() * r[1]


@pytest.mark.parametrize("m", [2, 16, 333, 2048])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_quant_8b_shapes(seed, m, static, with_residual):
    x = torch.randn(m, HIDDEN, dtype=BF16, device=DEV) * 2
    residual = torch.randn(m, HIDDEN, dtype=BF16, device=DEV) if with_residual else None
    w = (torch.rand(HIDDEN, device=DEV) + 0.5).to(BF16)
    scale = torch.tensor([0.01], device=DEV) if static else None
    got = rms_norm_quant_fp8(x, w, 1e-5, residual, scale=scale)
    normed = rms_norm(x, w, 1e-5, residual)
    assert_equals_unfused(got, quant_fp8(normed.out if with_residual else normed, scale), seed)
    if with_residual:
        assert torch.equal(got.residual, normed.residual), f"seed={seed}"
    ref = rms_norm_quant_fp8_ref(x, w, 1e-5, residual, scale=scale)
    assert rel_err(dequantized(got), dequantized(ref)) < 1e-2, f"seed={seed}"


@pytest.mark.parametrize("m", [2, 16, 333, 2048])
@pytest.mark.parametrize("inter", [INTER, 2 * INTER], ids=["8b", "wider-than-a-tile"])
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_silu_and_mul_quant_8b_shapes(seed, m, inter, static):
    x = torch.randn(m, 2 * inter, dtype=BF16, device=DEV) * 3
    scale = torch.tensor([0.05], device=DEV) if static else None
    got = silu_and_mul_quant_fp8(x, scale)
    assert_equals_unfused(got, quant_fp8(silu_and_mul(x), scale), seed)
    ref = silu_and_mul_quant_fp8_ref(x, scale)
    assert rel_err(dequantized(got), dequantized(ref)) < 1e-2, f"seed={seed}"


@needs_fp8_mma
def test_fused_modules_capture_in_a_cuda_graph(seed):
    """Fused norm -> FP8 projection, replayed from a graph, gives eager's output, which is the
    unfused norm's (the same e4m3 rows into the same matmuls)."""
    m = 64
    norm = RMSNorm(HIDDEN, 1e-5).to(DEV, BF16)
    norm.weight.data.uniform_(0.5, 1.5)
    up = Fp8Linear.from_float(torch.nn.Linear(HIDDEN, 2 * 1024, bias=False, device=DEV,
                                              dtype=BF16))
    down = Fp8Linear.from_float(torch.nn.Linear(1024, HIDDEN, bias=False, device=DEV,
                                                dtype=BF16))
    fused_norm = Fp8RMSNorm(norm, None)
    x = torch.randn(m, HIDDEN, dtype=BF16, device=DEV)
    residual = torch.randn(m, HIDDEN, dtype=BF16, device=DEV)

    def block(norm_mod):  # type: ignore[no-untyped-def]
        h, res = norm_mod(x, residual)
        return down(silu_and_mul(up(h))), res, isinstance(h, Fp8Activation)

    plain_out, plain_res, plain_fused = block(norm)
    eager_out, eager_res, eager_fused = block(fused_norm)
    assert eager_fused and not plain_fused
    assert torch.equal(eager_res, plain_res)
    assert rel_err(eager_out, plain_out) < 1e-3, f"seed={seed}"
    graph, (out, res, _) = capture(lambda: block(fused_norm))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(res, eager_res), f"seed={seed}"


TEXT = torch.randint(1, 512, (256,), generator=torch.Generator().manual_seed(0)).tolist()


@needs_fp8_mma
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_with_fusion_equals_without(tiny_models, arch, monkeypatch):
    """The engine's FP8 steps (chunks of 64 rows fuse, the batch-1 decodes do not) give the
    log-probabilities of the same model with every projection quantizing its own input."""
    calls = {"norm": 0, "act": 0}
    for name, key in (("rms_norm_quant_fp8", "norm"), ("silu_and_mul_quant_fp8", "act")):
        fn = getattr(kernels, name)

        def counted(*args, _fn=fn, _key=key, **kw):  # type: ignore[no-untyped-def]
            calls[_key] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(kernels, name, counted)
    engine = build(str(tiny_models[arch]), "cuda", "bfloat16", "auto", quantization="fp8")
    n_layers = len(engine.runner.model.model.layers)
    calls.update(norm=0, act=0)  # start-up (warm-up steps) fused too
    fused = score(engine, TEXT, 64, 16)
    assert calls == {"norm": 2 * n_layers * 4, "act": n_layers * 4}  # 4 chunks of 64
    monkeypatch.setattr(fp8_fusion, "fuses_quant", lambda x: False)
    unfused = score(engine, TEXT, 64, 16)
    assert calls == {"norm": 2 * n_layers * 4, "act": n_layers * 4}
    acc = compare(unfused, fused, TEXT)
    assert acc.mean_abs_dlogprob < 1e-2 and acc.top1_agreement >= 0.98, acc
