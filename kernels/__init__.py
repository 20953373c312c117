"""Triton kernels, one per file, each with a plain-torch reference `<name>_ref`.

Importing this package imports triton; on a machine without a GPU set TRITON_INTERPRET=1 first
to run the kernels on CPU tensors (slowly: small shapes only).
"""

from tandem.kernels.copy_blocks import copy_blocks, copy_blocks_ref
from tandem.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_ref
from tandem.kernels.fp8_quant import Fp8Rows, quant_fp8, quant_fp8_ref
from tandem.kernels.fp8_scale_product import fp8_scale_product, fp8_scale_product_ref
from tandem.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from tandem.kernels.paged_decode_launch import (
    SplitPolicy,
    decode_num_splits,
    decode_workspace_numel,
)
from tandem.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    prefill_block_q,
)
from tandem.kernels.rms_norm import RMSNormResidual, rms_norm, rms_norm_ref
from tandem.kernels.rms_norm_quant_fp8 import (
    RMSNormFp8,
    rms_norm_quant_fp8,
    rms_norm_quant_fp8_ref,
)
from tandem.kernels.rotary_embedding import rotary_embedding, rotary_embedding_ref
from tandem.kernels.rotary_store_kv import rotary_store_kv, rotary_store_kv_ref
from tandem.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from tandem.kernels.silu_and_mul_quant_fp8 import silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_ref
from tandem.kernels.store_kv import store_kv, store_kv_ref

__all__ = [
    "Fp8GemvConfig",
    "Fp8Rows",
    "RMSNormFp8",
    "RMSNormResidual",
    "SplitPolicy",
    "compiled_variants",
    "copy_blocks",
    "copy_blocks_ref",
    "decode_num_splits",
    "decode_workspace_numel",
    "fp8_gemv",
    "fp8_gemv_ref",
    "fp8_scale_product",
    "fp8_scale_product_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "prefill_block_q",
    "quant_fp8",
    "quant_fp8_ref",
    "rms_norm",
    "rms_norm_quant_fp8",
    "rms_norm_quant_fp8_ref",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "rotary_store_kv",
    "rotary_store_kv_ref",
    "silu_and_mul",
    "silu_and_mul_quant_fp8",
    "silu_and_mul_quant_fp8_ref",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
]


def compiled_variants() -> dict[str, int]:
    """Per Triton kernel of this package, the variants compiled in this process (all devices):
    what a request pays for on first use unless start-up compiled it (engine/warm_up.py)."""
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    counts: dict[str, int] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.__module__ == module.__name__:
                n = sum(len(cache[0]) for cache in obj.device_caches.values())
                counts[f"{info.name}.{name}"] = n
    return counts
