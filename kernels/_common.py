"""Helpers shared by the launchers: argument checks, device guards, device facts."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

# Under TRITON_INTERPRET=1 kernels run on CPU tensors; on a GPU box they need CUDA tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fix_interpreter_index() -> None:
    """triton 3.6's interpreter turns a scalar into an int with int(ndarray of shape (1,)),
    which numpy >= 2.4 refuses, so `range(start, end)` over loaded scalars fails
    (triton-lang/triton#9171, fixed upstream by #9172). Wrap its patcher to squeeze first."""
    from triton.runtime import interpreter  # noqa: PLC0415 - interpreter only

    original = interpreter._patch_lang_tensor
    if getattr(original, "_tandem_fixed", False):
        return

    def patch(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch._tandem_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch


def _fix_interpreter_fp8() -> None:
    """triton 3.6's interpreter converts to and from fp8 with its own bit arithmetic, which
    drops the carry when rounding up crosses a power of two (1.97 -> 1.0, not 2.0) and does
    not saturate at e4m3's 448. The GPU's conversion is correct: convert e4m3 with torch's
    (round to nearest even, saturating) so the interpreter matches it."""
    import numpy as np  # noqa: PLC0415 - interpreter only
    import triton.language as tl  # noqa: PLC0415
    from triton.runtime import interpreter  # noqa: PLC0415

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_tandem_fixed", False):
        return
    as_torch = {tl.float32: lambda d: torch.from_numpy(d.astype(np.float32)),
                tl.float16: lambda d: torch.from_numpy(d.astype(np.float16)),
                tl.bfloat16: lambda d: torch.from_numpy(d.view(np.int16)).view(torch.bfloat16),
                tl.float8e4nv: lambda d: torch.from_numpy(d.view(np.uint8)).view(FP8_DTYPE)}
    to_np = {tl.float32: lambda t: t.numpy(), tl.float16: lambda t: t.numpy(),
             tl.bfloat16: lambda t: t.view(torch.int16).numpy().view(np.uint16),
             tl.float8e4nv: lambda t: t.view(torch.uint8).numpy()}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if tl.float8e4nv not in (src_ty, dst_ty) or src_ty not in as_torch \
                or dst_ty not in as_torch:
            return original(self, src, dst_type, rounding_mode)
        x = as_torch[src_ty](np.ascontiguousarray(src.data))
        torch_dtype = {tl.float32: torch.float32, tl.float16: torch.float16,
                       tl.bfloat16: torch.bfloat16, tl.float8e4nv: FP8_DTYPE}[dst_ty]
        return interpreter.TensorHandle(to_np[dst_ty](x.to(torch_dtype)), dst_ty)

    create_fp_to_fp._tandem_fixed = True  # type: ignore[attr-defined]
    builder.create_fp_to_fp = create_fp_to_fp


def _fix_interpreter_bf16() -> None:
    """triton 3.6's interpreter truncates float32 -> bfloat16 (`x.to(tl.bfloat16)`: its own bit
    arithmetic without a rounding mode) where the GPU rounds to nearest even, so a kernel that
    rounds intermediates to bf16 drifts from torch on the CPU. Round with torch's conversion."""
    import numpy as np  # noqa: PLC0415 - interpreter only
    import triton.language as tl  # noqa: PLC0415
    from triton.runtime import interpreter  # noqa: PLC0415

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_trunc
    if getattr(original, "_tandem_fixed", False):
        return

    def create_fp_trunc(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, tl.bfloat16)

    create_fp_trunc._tandem_fixed = True  # type: ignore[attr-defined]
    builder.create_fp_trunc = create_fp_trunc


# FP8 KV cache (e4m3, torch.float8_e4m3fn / Triton fp8e4nv): a stored element is
# clamp(x / scale, -FP8_MAX, FP8_MAX) rounded to nearest even, one fp32 scale per (layer, KV
# head); a kernel reads it back as element * scale. The clamp makes every path saturate alike.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

if INTERPRET:
    _fix_interpreter_index()
    _fix_interpreter_fp8()
    _fix_interpreter_bf16()


def check(cond: bool, msg: str) -> None:
    """Argument check that survives `python -O` (launcher contracts, not internal invariants)."""
    if not cond:
        raise ValueError(msg)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.stride(-1) == 1, f"{name}: last dimension must be contiguous, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")
    if not INTERPRET:
        dev = next(iter(devices.values()))
        check(dev.type == "cuda", f"Triton kernels need CUDA tensors, got {dev} "
                                  "(set TRITON_INTERPRET=1 to run them on the CPU)")


def check_interpretable(dtype: torch.dtype) -> None:
    """The interpreter's tl.dot multiplies bfloat16 as raw 16-bit integers (triton 3.6): refuse
    rather than return garbage. float32 and float16 are fine."""
    check(not (INTERPRET and dtype == torch.bfloat16),
          "TRITON_INTERPRET=1 cannot run tl.dot on bfloat16; use float32 on the CPU")


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] in any float dtype, scale fp32 [H]: the e4m3 values the store kernels
    write."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def check_kv_scales(cache: torch.Tensor, num_kv_heads: int,
                    **scales: torch.Tensor | None) -> None:
    """Scales come with an FP8 cache and only with one: contiguous fp32 [num_kv_heads] each
    (one layer's row of the per-(layer, KV head) scales)."""
    fp8 = cache.dtype == FP8_DTYPE
    for name, s in scales.items():
        check((s is not None) == fp8, f"{name}: an FP8 cache needs per-KV-head scales and only "
                                      f"an FP8 cache takes them (cache {cache.dtype})")
        if s is not None:
            check(s.dtype == torch.float32 and s.shape == (num_kv_heads,) and s.is_contiguous(),
                  f"{name} must be contiguous fp32 [{num_kv_heads}], got {s.dtype} "
                  f"{tuple(s.shape)}")


def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                          rows: str) -> tuple[int, int, int, int]:
    """What both attention launchers check of q [rows, num_q_heads, head_dim] against a paged
    cache [num_blocks, block_size, num_kv_heads, head_dim] and its FP8 scales (`rows` names q's
    first dimension in messages). Returns (num_q_heads, head_dim, block_size, num_kv_heads)."""
    check(q.dim() == 3, f"q must be [{rows}, num_q_heads, head_dim], got {tuple(q.shape)}")
    _, num_q_heads, head_dim = q.shape
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, block_size, num_kv_heads, kd = k_cache.shape
    check(kd == head_dim, f"head_dim mismatch: q {head_dim}, cache {kd}")
    check(is_pow2(head_dim) and head_dim >= 16,
          f"head_dim must be a power of two >= 16, got {head_dim}")
    check(is_pow2(block_size) and block_size >= 8,
          f"block_size must be a power of two >= 8, got {block_size}")
    check(num_q_heads % num_kv_heads == 0,
          f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, FP8_DTYPE),
          f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    check_kv_scales(k_cache, num_kv_heads, k_scale=k_scale, v_scale=v_scale)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    check_interpretable(q.dtype)
    return num_q_heads, head_dim, block_size, num_kv_heads


def output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An attention launcher's output: `out` checked to be like q, or a new tensor like q."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check(out.shape == q.shape and out.dtype == q.dtype, "out must be like q")
    check_last_dim_contiguous("out", out)
    return out


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device; make it the tensors' device."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (a nominal 8 on the CPU interpreter)."""
    if device.type != "cuda":
        return 8
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def resident_programs(kernel, device: torch.device) -> int:  # type: ignore[no-untyped-def]
    """How many programs of a compiled Triton kernel (`JITFunction.warmup`'s result) one SM
    of the device holds at once, as the CUDA occupancy calculator counts them: bounded by
    registers (allocated per warp in units of 256), shared memory (1 KiB reserved per block),
    threads and 32 blocks."""
    kernel._init_handles()  # loads the binary: n_regs is known from then on
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    regs_per_warp = -(-max(kernel.n_regs, 1) * 32 // 256) * 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * warps)
    by_smem = props.shared_memory_per_multiprocessor // (kernel.metadata.shared + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
