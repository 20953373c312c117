"""Narrow, frozen configs. The Hugging Face config is converted once into ModelConfig; every
component receives only the config it uses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.models.registry import check_architecture
from tandem.errors import InvalidArgument, ModelLoadError

DTYPES = ("float32", "bfloat16", "float16")
MAX_N = 16  # samples per request (n), the default limit of workers and router alike
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8: e4m3
QUANTIZATIONS = ("fp8",)  # weights; an FP8 checkpoint is recognised without the flag
SPECULATIVE_METHODS = ("ngram", "draft")  # engine/spec_decode/


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as Hugging Face configs spell it: rope_type none, linear or llama3."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"rope_scaling.rope_type {self.rope_type!r} is not supported "
                                 "(supported: default, linear, llama3)")


@dataclass(frozen=True)
class ModelConfig:
    """What every model shares, read from any architecture's config.json the same way; what
    differs between architectures (q/k norms, biases, multipliers) the model class declares
    (engine/models/layers.py, CausalLM), reading its own fields from `hf_config`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # the config's; a model class may have biases regardless (Qwen2)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None
    # config.json as read, for the fields only one architecture has (Granite's multipliers);
    # not compared: two configs of the same model are equal whatever else their files hold.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served. Within the sliding window, sliding-window
        attention equals full attention, so a windowed model is served up to its window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json has no 'architectures' entry")
        arch = archs[0]
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers 5 writes rope_parameters; older checkpoints write rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)),
        )
        # A window applies unless the config turns it off (Qwen's use_sliding_window: false
        # beside a sliding_window value), as transformers reads it.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=window,
            hf_config=dict(cfg),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelLoadError(f"model: no config.json in {path}")
        try:
            cfg = json.loads(p.read_text())
            # Instruct checkpoints list end-of-turn ids (e.g. <|eot_id|>) only in
            # generation_config.json; generation stops at any of them.
            gen = Path(path) / "generation_config.json"
            if gen.is_file():
                extra = json.loads(gen.read_text()).get("eos_token_id")
                extra = extra if isinstance(extra, list) else [] if extra is None else [extra]
                base = cfg.get("eos_token_id")
                base = base if isinstance(base, list) else [] if base is None else [base]
                cfg = {**cfg, "eos_token_id": list(dict.fromkeys(base + extra))}
            return cls.from_hf_dict(cfg)
        except (KeyError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"model: config.json in {path} is invalid: {e!r}") from e


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool. Either num_blocks is given, or the pool takes `memory_fraction` of the
    device's free memory after a profiling pass (CUDA) or `cpu_kv_bytes` (CPU)."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.9
    cpu_kv_bytes: int = 256 << 20
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidArgument("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidArgument("num_blocks", f"must be >= 1, got {self.num_blocks}")
        if not 0 < self.memory_fraction <= 1:
            raise InvalidArgument("memory_fraction", f"must be in (0, 1], got {self.memory_fraction}")


SCHEDULING_POLICIES = ("fcfs", "critical-path")  # engine/wait_queue.py


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 512
    max_model_len: int = 4096
    policy: str = "fcfs"
    # critical-path: the fewest tokens a paced step gives work off the path (engine/scheduler.py)
    min_step_tokens: int = 256
    # critical-path: pace the work off the path. Not in role prefill: its requests end at their
    # first token, so only the order applies there (the longest generations' prompts first).
    pace: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "min_step_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")
        if self.policy not in SCHEDULING_POLICIES:
            raise InvalidArgument("scheduling_policy", f"must be one of "
                                  f"{', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` proposes up to `num_tokens` draft tokens per running
    sequence, the model scores them in one step (engine/spec_decode/)."""

    method: str
    num_tokens: int = 3
    draft_model: str | None = None
    max_batch: int = 32  # no speculation in a step with more running sequences
    ngram_max: int = 4  # prompt lookup: the longest suffix matched
    ngram_min: int = 2  # ... and the shortest
    # Method draft: the draft model's KV pool, in blocks (None: sized by draft_memory_fraction
    # of the free device memory on a GPU, by the CPU KV budget on the CPU).
    draft_num_blocks: int | None = None
    draft_memory_fraction: float = 0.1
    # Back-off by acceptance (engine/spec_decode/backoff.py): a sample whose running average
    # of accepted / proposed drafts falls below min_acceptance stops speculating for
    # probe_interval steps, then tries again. 0: off.
    min_acceptance: float = 0.3
    probe_interval: int = 16

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidArgument("speculative_method", f"must be one of "
                                  f"{', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_tokens <= 16:
            raise InvalidArgument("num_speculative_tokens",
                                  f"must be in [1, 16], got {self.num_tokens}")
        if (self.method == "draft") != bool(self.draft_model):
            raise InvalidArgument("draft_model", "is required with speculative_method draft, "
                                  "and only with it")
        if self.draft_num_blocks is not None and self.draft_num_blocks < 1:
            raise InvalidArgument("draft_num_blocks", f"must be >= 1, got {self.draft_num_blocks}")
        if not 0 < self.draft_memory_fraction < 1:
            raise InvalidArgument("draft_memory_fraction",
                                  f"must be in (0, 1), got {self.draft_memory_fraction}")
        if not 0 <= self.min_acceptance <= 1:
            raise InvalidArgument("speculative_min_acceptance",
                                  f"must be in [0, 1], got {self.min_acceptance}")
        if self.probe_interval < 1:
            raise InvalidArgument("speculative_probe_interval",
                                  f"must be >= 1, got {self.probe_interval}")
        if self.max_batch < 1:
            raise InvalidArgument("speculative_max_batch", f"must be >= 1, got {self.max_batch}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidArgument("ngram_min", "must be in [1, ngram_max]")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` and the workers accept, validated."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    load_format: str = "auto"  # auto | dummy
    seed: int = 0
    role: str = "both"  # both | prefill | decode
    max_n: int = MAX_N
    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.9
    cpu_kv_bytes: int = 256 << 20
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 512
    max_model_len: int | None = None
    scheduling_policy: str = "fcfs"
    min_step_tokens: int = 256
    cuda_graphs: bool = True
    # Steps with prefill chunks from CUDA graphs too (engine/cuda_graphs.py), not only decodes.
    mixed_cuda_graphs: bool = True
    # Pipelined steps: the host schedules step N+1 while the device runs step N
    # (engine/async_step.py), falling back per step where it cannot. None: on CUDA only (on
    # the CPU nothing overlaps, and every output would come a step later).
    async_scheduling: bool | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    # Ranks (processes, one device each) the model is split over (engine/parallel.py).
    tensor_parallel_size: int = 1
    # Speculative decoding (engine/spec_decode/): a proposer's drafts checked by the model in
    # one step. None: off.
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    draft_model: str | None = None  # method draft: a smaller checkpoint, same tokenizer
    # Back-off: no speculation in a step with more running sequences than this.
    speculative_max_batch: int = 32
    # ... nor for a sample whose drafts are rarely accepted (SpeculativeConfig).
    speculative_min_acceptance: float = 0.3
    speculative_probe_interval: int = 16
    # Method draft: the draft model's own KV pool (SpeculativeConfig).
    draft_num_blocks: int | None = None
    draft_memory_fraction: float = 0.1
    # Host-memory KV tier under the prefix cache (engine/host_kv_tier.py), in GiB. None: a
    # share of the available host memory on CUDA, off on the CPU; 0: off.
    host_kv_cache_gb: float | None = None
    # Share the tier with the other workers of this host that give the same name
    # (engine/shared_host_tier.py); "": the tier is this engine's own.
    host_kv_share: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("model", "is required")
        if self.dtype not in DTYPES:
            raise InvalidArgument("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise InvalidArgument("load_format", f"must be auto or dummy, got {self.load_format!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise InvalidArgument("role", f"must be both, prefill or decode, got {self.role!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgument("device", f"must be cpu or cuda[:N], got {self.device!r}")
        if self.max_n < 1:
            raise InvalidArgument("max_n", f"must be >= 1, got {self.max_n}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgument("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}"
                                                    f", got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidArgument("quantization", f"must be one of {', '.join(QUANTIZATIONS)}, "
                                                  f"got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise InvalidArgument("tensor_parallel_size",
                                  f"must be >= 1, got {self.tensor_parallel_size}")
        self._check_host_tier()
        # Build the narrow configs now so that bad values fail at construction.
        self.cache_config()
        self.speculative_config()

    def _check_host_tier(self) -> None:
        gb = self.host_kv_cache_gb
        if self.host_kv_share:
            from tandem.engine.shared_host_tier import segment_path  # noqa: PLC0415 - torch

            segment_path(self.host_kv_share)  # a valid name, or refused naming the field
            if not gb:
                raise InvalidArgument("host_kv_share", "needs host_kv_cache_gb > 0, the same on "
                                                       "every worker sharing the tier")
            if self.tensor_parallel_size > 1:
                raise InvalidArgument("host_kv_share", "is not supported with "
                                                       "tensor_parallel_size > 1: a worker's "
                                                       "ranks keep a tier of their own each")
        if gb is None or gb == 0:
            return
        if not gb > 0:
            raise InvalidArgument("host_kv_cache_gb", f"must be >= 0, got {gb}")
        if not self.enable_prefix_caching:
            raise InvalidArgument("host_kv_cache_gb", "needs the prefix cache (it keeps the "
                                                      "blocks the prefix cache evicts)")

    def host_tier_enabled(self) -> bool:
        """Whether the engine may have a host tier (its size decides in the end)."""
        return self.enable_prefix_caching and self.host_kv_cache_gb != 0

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.num_blocks, self.memory_fraction,
                           self.cpu_kv_bytes, self.enable_prefix_caching)

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_method is None:
            if self.draft_model is not None:
                raise InvalidArgument("draft_model", "goes with speculative_method draft")
            return None
        if self.speculative_method == "draft" and self.tensor_parallel_size > 1:
            raise InvalidArgument("draft_model", "a draft model is served at tensor-parallel "
                                  "size 1 only")
        return SpeculativeConfig(
            self.speculative_method, self.num_speculative_tokens, self.draft_model,
            self.speculative_max_batch, draft_num_blocks=self.draft_num_blocks,
            draft_memory_fraction=self.draft_memory_fraction,
            min_acceptance=self.speculative_min_acceptance,
            probe_interval=self.speculative_probe_interval)

    def scheduler_config(self, model: ModelConfig) -> SchedulerConfig:
        max_len = min(self.max_model_len or model.max_model_len, model.max_model_len)
        # A prefill worker's requests end at their first token: ordered, not paced, by outputs.
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs, max_len,
                               self.scheduling_policy, self.min_step_tokens,
                               pace=self.role != "prefill")


def cdiv(a: int, b: int) -> int:
    return -(a // -b)
