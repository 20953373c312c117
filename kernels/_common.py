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


if INTERPRET:
    _fix_interpreter_index()


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


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
