"""Quantization, applied from outside the model files: the FP8 KV cache's dtype and scales
(kv_cache.py) and FP8 linear layers swapped in for the models' projections (fp8.py), with the
checkpoint formats they load from (checkpoint.py)."""
