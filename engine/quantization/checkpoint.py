"""Which FP8 weight scheme a model is served with: from `--quantization fp8` (quantize a
bf16/fp32 checkpoint at load) or from the checkpoint's own `quantization_config`.

Checkpoint formats read (config.json `quantization_config`):

    {"quant_method": "fp8", "activation_scheme": "static" | "dynamic",
     "ignored_layers": [...]}                                     (vLLM / AutoFP8 / HF FP8)
    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "float", "strategy": "tensor" | "channel"},
         "input_activations": {"num_bits": 8, "type": "float", "dynamic": true | false} | null}},
     "ignore": ["lm_head", ...]}                                  (llm-compressor)

with, per quantized linear `X`: `X.weight` in float8_e4m3fn, `X.weight_scale` fp32 (one
element per tensor, or [out, 1] per channel) and, for static activations, `X.input_scale`
(one element). Block-wise scales (weight_block_size) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import ModelLoadError


@dataclass(frozen=True)
class Fp8Scheme:
    """How the projections of the decoder layers become Fp8Linear layers.

    from_checkpoint: the checkpoint holds e4m3 weights and their scales (layers are swapped
        before loading); otherwise float weights are loaded and quantized per output channel.
    static_input: the checkpoint carries a calibrated input_scale per layer; otherwise
        activations are quantized per token at run time.
    ignore: Hugging Face module names (or "re:" patterns) left unquantized; lm_head always is.
    """

    from_checkpoint: bool
    static_input: bool = False
    ignore: tuple[str, ...] = ()


def fp8_scheme(model_dir: Path | None, quantization: str | None) -> Fp8Scheme | None:
    """The scheme for a checkpoint (None: dummy weights) and the `--quantization` flag; None
    when the model runs unquantized."""
    qc = _quantization_config(model_dir) if model_dir is not None else None
    if qc is None:
        return Fp8Scheme(from_checkpoint=False) if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ModelLoadError("model: block-wise FP8 weight scales (weight_block_size) are "
                                 "not supported; per-tensor and per-channel scales are")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ModelLoadError(f"model: FP8 activation_scheme {scheme!r} is not supported")
        ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
        return Fp8Scheme(True, scheme == "static", tuple(ignore))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ModelLoadError(f"model: quantization_config quant_method {method!r} is not "
                         "supported (fp8 and compressed-tensors float-quantized FP8 are)")


def _quantization_config(model_dir: Path) -> dict[str, Any] | None:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("quantization_config")
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"model: config.json in {model_dir} is invalid: {e!r}") from e


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt != "float-quantized" or len(groups) != 1:
        raise ModelLoadError(f"model: compressed-tensors format {fmt!r} with {len(groups)} "
                             "config groups is not supported (one float-quantized group is)")
    group = groups[0]
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fp8 = {"num_bits": 8, "type": "float"}
    if any(weights.get(k) != v for k, v in fp8.items()) or \
            weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic"):
        raise ModelLoadError(f"model: compressed-tensors weights {weights} are not FP8 with "
                             "static per-tensor or per-channel scales")
    if acts is not None and any(acts.get(k) != v for k, v in fp8.items()):
        raise ModelLoadError(f"model: compressed-tensors input_activations {acts} are not FP8")
    if "Linear" not in (group.get("targets") or []):
        raise ModelLoadError(f"model: compressed-tensors targets {group.get('targets')} "
                             "do not include Linear")
    static = acts is not None and not acts.get("dynamic", True)
    return Fp8Scheme(True, static, tuple(qc.get("ignore") or ()))
