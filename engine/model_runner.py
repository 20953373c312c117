"""The model runner: owns the model, the KV pool and the attention backend; turns a scheduled
batch into tensors, runs the forward pass and samples.

KV pool, one tensor, block-major (a transfer moves one chunk per block; kernels take strides,
never a contiguous per-layer tensor):

    pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
         └ block b of a request: all layers, K and V, one contiguous chunk

in the KV cache dtype (`kv_cache_dtype`: the model's, or e4m3 with per-(layer, KV head) scales,
engine/quantization/kv_cache.py). With an FP8 weight scheme (`quantization`, or an FP8
checkpoint) the decoder layers' projections are swapped for FP8 layers around the weight load
(engine/quantization/fp8.py), and the norms in front of them for ones that hand them quantized
rows (engine/quantization/fp8_fusion.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from tandem.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    forward_context,
    prefill_tiles,
)
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.block_table import BlockTableMirror
from tandem.engine.config import CacheConfig, ModelConfig, cdiv
from tandem.engine.cuda_graphs import CudaGraphRunner, MixedGraphRunner
from tandem.engine.loader import build_model, init_dummy_weights, load_weights
from tandem.engine.models.layers import CausalLM
from tandem.engine.parallel import TPState, all_min, kv_heads_per_rank, rank_heads
from tandem.engine.pool_sizing import ProfileRuns, blocks_for_budget
from tandem.engine.quantization import fp8, fp8_fusion, kv_cache
from tandem.engine.quantization.checkpoint import fp8_scheme
from tandem.engine.sampler import Sampler, SamplerOutput, SampleRow
from tandem.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.engine.step_tokens import PendingTokens, TokenFill
from tandem.errors import InvalidArgument
from tandem.kvtransfer.pool import TORCH_DTYPES

log = logging.getLogger(__name__)

# (shape, dtype, device) -> the pool tensor. Services pass one that allocates shareable memory.
MAX_GRAPH_BATCH = 512  # decode batches above this run eagerly (capture time and memory)

PoolFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


class StepPeers(Protocol):
    """The other tensor-parallel ranks, as rank 0's runner sees them (engine/tp_group.py's
    TPGroup): each step's inputs go to them before rank 0 runs it."""

    def step(self, inputs: StepInputs) -> None: ...


def default_pool_factory(shape: tuple[int, ...], dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, *, device: str,
                 dtype: str, model_dir: Path | None, load_format: str = "auto", seed: int = 0,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 4096,
                 max_num_seqs: int = 256, cuda_graphs: bool = True,
                 mixed_cuda_graphs: bool = True,
                 pool_factory: PoolFactory | None = None, progress: bool = True,
                 kv_cache_dtype_name: str = "auto", quantization: str | None = None,
                 tp: TPState | None = None) -> None:
        self.config = model_config
        # Tensor parallelism (engine/parallel.py): this rank's heads; rank 0 hands every step's
        # inputs to the other ranks through `peers` (engine/tp_group.py) before running it.
        self.tp = tp if tp is not None and tp.size > 1 else None
        n = self.tp.size if self.tp else 1
        self.num_heads = model_config.num_heads // n
        self.num_kv_heads = kv_heads_per_rank(model_config.num_kv_heads, n)
        self.peers: StepPeers | None = None
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        # The stream every step runs on (the thread's current one; nothing here changes it).
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" \
            else None
        self.dtype = TORCH_DTYPES[dtype]
        self.kv_dtype = kv_cache.kv_cache_dtype(kv_cache_dtype_name, self.dtype)
        kv_cache.check_device(self.kv_dtype, self.device)
        self.kv_scales = (kv_cache.KVScales.ones(model_config.num_layers,
                                                 self.num_kv_heads, self.device)
                          if self.kv_dtype == kv_cache.FP8_DTYPE else None)
        self.block_size = cache_config.block_size
        torch.manual_seed(seed)
        self.model = self._load_model(model_dir, load_format, seed, quantization, progress)
        self.sampler = Sampler(model_config.vocab_size, self.device,
                               model_config.eos_token_ids)

        self.max_num_seqs = max_num_seqs  # the most decode rows a captured step has
        self.block_tables = BlockTableMirror(2 * max_num_seqs + 16,
                                             cdiv(max_model_len, self.block_size))
        # With tensor parallelism every rank captures the same ladder (its all-reduces inside)
        # and replays the same size each step: rank 0 decides from inputs every rank receives.
        use_graphs = cuda_graphs and self.device.type == "cuda"
        graph_bs = min(max_num_seqs, MAX_GRAPH_BATCH) if use_graphs else 0
        self.graphs: CudaGraphRunner | None = None  # captured once the pool exists
        # Query tokens per work item of the GPU's prefill attention (0: the CPU backend).
        self.prefill_block_q = 0
        if self.device.type == "cuda":
            from tandem.kernels.paged_prefill_attention import prefill_block_q  # noqa: PLC0415 - Triton

            self.prefill_block_q = prefill_block_q(model_config.head_dim,
                                                   self.num_heads // self.num_kv_heads)
        # Steps with prefill chunks from graphs too (engine/cuda_graphs.py), but not under
        # tensor parallelism (its steps are broadcast and replayed eagerly there).
        mixed = use_graphs and mixed_cuda_graphs and self.tp is None
        self.mixed_graphs: MixedGraphRunner | None = None
        # Whether the last step's multi-token rows ran as decode rows (_as_decode_rows).
        self.last_decode_rows = False
        self.num_blocks = cache_config.num_blocks or self._pool_blocks(
            cache_config, max_num_batched_tokens, max_model_len, max_num_seqs, graph_bs, mixed)
        if self.tp is not None:  # block ids mean the same on every rank: one pool size
            self.num_blocks = all_min(self.num_blocks, self.tp)
        self.pool = (pool_factory or default_pool_factory)(self.pool_shape(self.num_blocks),
                                                            self.kv_dtype, self.device)
        self.backend = self._make_backend(self.pool)
        if self.device.type == "cuda":
            from tandem.engine.warm_up import has_fp8_linear, warm_up  # noqa: PLC0415 - Triton, CUDA only

            # Every Triton variant a step can launch, compiled now.
            warm_up(self._warm_up_step, self.backend, self.pool, self.block_size, self.dtype,
                    has_fp8_linear(self.model))
        if use_graphs:
            self.graphs = CudaGraphRunner(self.model, self.backend, graph_bs,
                                          cdiv(max_model_len, self.block_size), self.device)
            self.graphs.capture()
            if self.tp is None:  # (a tensor-parallel projection all-reduces: not timed alone)
                self.graphs.pick_sizes(self.model.model.layers[0], self.dtype)
        if mixed:
            self.mixed_graphs = MixedGraphRunner(
                self.model, self.backend, max_num_batched_tokens, max_num_seqs,
                cdiv(max_model_len, self.block_size), self.device)
            self.mixed_graphs.capture()

    def _load_model(self, model_dir: Path | None, load_format: str, seed: int,
                    quantization: str | None, progress: bool) -> CausalLM:
        """Build the model on its device and fill its weights, and an FP8 cache's scales from
        the checkpoint's calibrated ones where it has them; with an FP8 scheme the projections
        become FP8 layers around the load (shells before an FP8 checkpoint's, quantized after a
        float one's)."""
        model = build_model(self.config, self.dtype, self.device, self.tp)
        scheme = fp8_scheme(model_dir if load_format != "dummy" else None, quantization)
        if scheme is not None and self.tp is not None:
            raise InvalidArgument("tensor_parallel_size", "FP8 weights are served at tensor-"
                                  "parallel size 1 only")
        if scheme is not None:
            fp8.check_device(self.device, self.dtype)
            fp8.prepare(model, scheme)
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            # A calibrated FP8 checkpoint's KV-cache scales: this rank's heads' into kv_scales
            # (before the pool exists, so before any KV is written), or ignored without an FP8
            # cache.
            n = self.tp.size if self.tp else 1
            heads = rank_heads(self.config.num_kv_heads, n, self.tp.rank if self.tp else 0)
            kv = kv_cache.CheckpointKVScales(self.kv_scales, self.config.num_layers,
                                             self.config.num_kv_heads, heads)
            load_weights(model, model_dir, progress=progress, kv_scales=kv)
        if scheme is not None:
            fp8.finish(model, scheme)
            # The norms and SiLU-and-mul in front of FP8 projections quantize for them.
            fp8_fusion.fuse_activation_quant(model)
        return model

    # -- KV pool -----------------------------------------------------------------------------
    def _pool_blocks(self, cache: CacheConfig, max_tokens: int, max_model_len: int,
                     max_num_seqs: int, graph_bs: int, mixed_graphs: bool) -> int:
        """Blocks of the pool: on a GPU, what the largest step and the CUDA graphs leave of its
        memory, measured by profile runs (engine/pool_sizing.py)."""
        rows = min(max_num_seqs, max_tokens)
        runs = ProfileRuns(max_tokens, rows,
                           lambda: self._profile_run(max_tokens, max_model_len, rows),
                           (lambda: self._profile_decode(graph_bs)) if graph_bs else None,
                           mixed_graphs)
        return blocks_for_budget(self.device, cache, self.block_bytes, self.block_size,
                                 max_model_len, runs)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        c = self.config
        return (num_blocks, c.num_layers, 2, self.block_size, self.num_kv_heads, c.head_dim)

    @property
    def block_bytes(self) -> int:
        c = self.config
        return (c.num_layers * 2 * self.block_size * self.num_kv_heads * c.head_dim
                * self.kv_dtype.itemsize)  # 1 byte an element in an FP8 pool

    def _make_backend(self, pool: torch.Tensor) -> AttentionBackend:
        scale = self.model.attention_scale
        if pool.is_cuda:
            from tandem.engine.attention.triton_backend import TritonAttentionBackend  # noqa: PLC0415 - Triton, CUDA only

            return TritonAttentionBackend(pool, self.num_heads, scale, self.kv_scales,
                                          max_rows=self.max_num_seqs)
        return TorchAttentionBackend(pool, self.num_heads, scale, self.kv_scales)

    def _profile_run(self, num_tokens: int, max_model_len: int, rows: int) -> None:
        """The largest step the scheduler can issue: sequences of up to max_model_len tokens
        filling the token budget, over a throwaway pool, and `rows` rows sampled."""
        seq_len = min(num_tokens, max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens %
                                                       seq_len else [])
        last = [sum(lens[:i + 1]) - 1 for i in range(len(lens))]
        self._profile_step(lens, [last[i % len(last)] for i in range(rows)], sample=True)

    def _profile_decode(self, num_seqs: int) -> None:
        """A decode step of num_seqs sequences as the CUDA graphs run it: logits for every
        row and their argmax."""
        self._profile_step([1] * num_seqs, list(range(num_seqs)), sample=False)

    def _warm_up_step(self, lens: list[int], last: list[int]) -> None:
        self._profile_step(lens, last, sample=False, backend=self.backend)

    def _profile_step(self, lens: list[int], last: list[int], sample: bool,
                      backend: AttentionBackend | None = None) -> None:
        """One eager step of sequences of `lens` new tokens (1: a decode), sampling the
        flattened tokens `last`: over a throwaway pool, or `backend`'s (its first blocks)."""
        per_seq = cdiv(max(lens), self.block_size)
        if backend is None:
            backend = self._make_backend(torch.empty(self.pool_shape(len(lens) * per_seq),
                                                     dtype=self.kv_dtype, device=self.device))
        batch = ScheduledBatch()
        for i, n in enumerate(lens):
            seq = Sequence(f"profile-{i}", [0] * n, SamplingParams())
            seq.block_ids = list(range(i * per_seq, (i + 1) * per_seq))
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
        ids, pos, meta, sample_index = self._inputs(batch, last, backend)
        with torch.inference_mode(), forward_context(backend, meta):
            hidden = self.model(ids, pos)
            logits = self.model.compute_logits(hidden[sample_index])
            if sample:
                heaviest = SamplingParams(temperature=1.0, top_k=50, top_p=0.9,
                                          repetition_penalty=1.1, frequency_penalty=0.1,
                                          logprobs=MAX_LOGPROBS)
                self.sampler(logits, [SampleRow(heaviest, 0, 0, [0], [0]) for _ in last])
            else:
                logits.argmax(dim=-1)
        for seq in batch.seqs:
            self.release(seq.seq_id)

    # -- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, rows: list[SampleRow], row_token_index: list[int],
                fill: TokenFill | None = None, defer: bool = False,
                before_sample: Callable[[], None] | None = None) -> SamplerOutput | PendingTokens:
        """Run one step. rows[i] samples from the logits of flattened token row_token_index[i].
        With tensor parallelism every rank runs the forward pass on the same inputs; rank 0
        (here) samples from the gathered logits.

        Pipelined steps (engine/async_step.py): `fill` puts the previous step's sampled tokens
        (still on the device) in place of this step's placeholder token ids, and `defer`
        returns the sampled tokens as PendingTokens (a copy to the host under way) instead of
        waiting for them: the whole call only launches work. `before_sample` runs on the host
        between launching the forward pass and sampling (a grammar row's previous token)."""
        inputs = self.step_inputs(batch, row_token_index)
        if self.peers is not None:
            assert fill is None, "a pipelined step never runs tensor-parallel"
            self.peers.step(inputs)
        logits, greedy = self.forward(inputs, fill)
        if before_sample is not None:
            before_sample()
        extra = None
        if len(row_token_index) > len(rows):  # rows past the sampled ones: prompt logprobs
            extra, logits = logits[len(rows):], logits[:len(rows)]
            greedy = greedy[:len(rows)] if greedy is not None else None
        if defer:
            # A CUDA graph's greedy tokens are its output buffer, which its next replay
            # rewrites: both their readers, the copy to the host started here and the next
            # step's placeholder fill (queued before that step's forward pass), come first on
            # this stream, so they are not copied.
            tokens = self.sampler.sample(logits, rows, greedy)[0]
            return PendingTokens(tokens, self.stream)
        out = self.sampler(logits, rows, greedy)
        out.extra_logits = extra
        return out

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, fill: TokenFill | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits (float32, one row per sampled row) and, from a CUDA graph, their
        argmax. Every rank of a tensor-parallel group calls this with the same inputs."""
        if inputs.copies:
            src = _to([s for s, _ in inputs.copies], torch.long, self.device)
            dst = _to([d for _, d in inputs.copies], torch.long, self.device)
            self.pool[dst] = self.pool[src]
        if inputs.use_graph:  # straight into the graphs' input buffers
            return self.graphs.run_step(inputs.token_ids, inputs.positions, inputs.slots,
                                        inputs.seq_lens, inputs.block_table,
                                        inputs.row_token_index, fill)
        ids, pos, meta, sample_index = self._device_inputs(inputs, fill)
        if inputs.use_mixed_graph:
            return self.mixed_graphs.run(ids, pos, meta, sample_index)
        with forward_context(self.backend, meta):
            hidden = self.model(ids, pos)
        return self.model.compute_logits(hidden[sample_index]), None

    def step_inputs(self, batch: ScheduledBatch, row_token_index: list[int]) -> StepInputs:
        """The step as host lists (what rank 0 sends the other ranks)."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        mirror_row = self.block_tables.row
        width = max(len(s.block_ids) for s in batch.seqs)
        # Verify rows and short tails as decode rows, unless there are decode graphs and too
        # few rows in them (the mixed-step graphs may hold the step as chunks).
        as_decodes = _as_decode_rows(batch) and (
            self.graphs is None or self.graphs.can_run(batch.num_tokens, width))
        self.last_decode_rows = as_decodes
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            blocks = seq.block_ids
            if n == 1:
                token_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                token_ids.extend(seq.token_ids[start:end])
                if end > len(seq.token_ids):  # a verify row: its drafts after its last token
                    token_ids.extend(seq.spec_token_ids[:end - len(seq.token_ids)])
                positions.extend(range(start, end))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            row = mirror_row(seq)
            if as_decodes:  # one decode row per position, each seeing the keys up to its own
                seq_lens.extend(range(start + 1, end + 1))
                rows.extend([row] * n)
            else:
                seq_lens.append(end)
                rows.append(row)
        query_lens = [1] * len(token_ids) if as_decodes else list(batch.num_new_tokens)
        num_decodes = len(token_ids) if as_decodes else batch.num_decodes
        # Rank 0 decides for every tensor-parallel rank: all must run the same collectives.
        decode_only = num_decodes == len(seq_lens)
        use_graph = (self.graphs is not None and decode_only
                     and self.graphs.can_run(len(seq_lens), width))
        use_mixed = (self.mixed_graphs is not None and not decode_only
                     and self.mixed_graphs.can_run(len(token_ids), len(batch.seqs),
                                                   len(row_token_index), width))
        return StepInputs(token_ids, positions, slots, seq_lens, query_lens, num_decodes,
                          row_token_index, self.block_tables.gather(rows, width),
                          list(batch.copies), use_graph, use_mixed)

    def _inputs(self, batch: ScheduledBatch, row_token_index: list[int],
                backend: AttentionBackend | None = None):
        return self._device_inputs(self.step_inputs(batch, row_token_index), backend=backend)

    def _device_inputs(self, inputs: StepInputs, fill: TokenFill | None = None,
                       backend: AttentionBackend | None = None):
        """The step's tensors, in two host-to-device copies (one int64, one int32) plus the
        block table, for `backend` (default: the runner's). `fill`: placeholder token ids
        replaced on the device, from the previous step's sampled tokens (its indices travel in
        the int64 copy)."""
        backend = backend or self.backend
        t = len(inputs.token_ids)
        b = len(inputs.seq_lens)
        qsl = [0]
        for n in inputs.query_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        extra = fill.dst + fill.src if fill else []
        longs = _to(inputs.token_ids + inputs.positions + inputs.slots
                    + inputs.row_token_index + extra, torch.long, dev)
        r = 3 * t + len(inputs.row_token_index)
        if fill:
            k = len(fill.dst)
            # Stream order makes this exact: the previous step's sampling kernels ran before
            # this gather, and this step's forward (graph replay or eager) runs after it.
            longs[:t].index_copy_(0, longs[r:r + k],
                                  fill.tokens.index_select(0, longs[r + k:r + 2 * k]))
        # The prefill kernel's work items (GPU): the chunks after the decodes, counted from the
        # first of them (eager), or from sequence 0 (a step replayed from a mixed-step graph).
        nd = inputs.num_decodes
        block_q = self.prefill_block_q
        tiles = []
        if block_q and b > nd:
            tiles = (prefill_tiles(inputs.query_lens, block_q, first=nd) if inputs.use_mixed_graph
                     else prefill_tiles(inputs.query_lens[nd:], block_q))
        # The decode kernel's plan (GPU): over the step's decodes, or over every sequence row
        # of the mixed-step graph it replays, padded to that graph's capacity.
        plan = np.empty((0, 2), dtype=np.int32)
        if inputs.use_mixed_graph:
            rows = self.mixed_graphs.seqs(self.mixed_graphs.size_for(
                t, max(b, len(inputs.row_token_index))))
            if capacity := backend.plan_capacity(rows):
                plan = backend.plan(inputs.seq_lens[:nd] + [0] * (rows - nd), capacity)
        elif nd and backend.plan_capacity(nd):
            plan = backend.plan(inputs.seq_lens[:nd])
        ints = _to(np.concatenate([np.asarray(qsl + inputs.seq_lens + tiles, dtype=np.int32),
                                   plan.ravel()]), torch.int32, dev)
        table = torch.from_numpy(inputs.block_table)
        if dev.type == "cuda":
            table = table.pin_memory().to(dev, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=longs[2 * t:3 * t], query_start_loc=ints[:b + 1],
            seq_lens=ints[b + 1:2 * b + 1], block_tables=table, num_decodes=inputs.num_decodes,
            max_query_len=max(inputs.query_lens), max_seq_len=max(inputs.seq_lens),
            query_lens_cpu=inputs.query_lens, seq_lens_cpu=inputs.seq_lens,
            prefill_tiles=ints[2 * b + 1:2 * b + 1 + len(tiles)].view(-1, 2) if tiles else None,
            decode_plan=ints[2 * b + 1 + len(tiles):].view(-1, 2) if plan.size else None)
        return longs[:t], longs[t:2 * t], meta, longs[3 * t:r]

    def close(self) -> None:
        """Release the CUDA graphs (before a tensor-parallel group is destroyed)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()
            self.mixed_graphs = None

    def release(self, seq_id: int) -> None:
        """A sequence finished: its block-table row is free again."""
        self.block_tables.release(seq_id)


@dataclass
class StepInputs:
    """One step on the host: flattened tokens in the backend's order (decodes first), each
    sequence's context length and new tokens, the rows that sample, the block table and the
    copy-on-write copies. Plain lists and a CPU tensor: what rank 0 broadcasts."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    num_decodes: int
    row_token_index: list[int]
    block_table: np.ndarray  # int32 [B, width]
    copies: list[tuple[int, int]] = field(default_factory=list)
    use_graph: bool = False  # a pure decode step that a captured CUDA graph replays
    use_mixed_graph: bool = False  # a step with prefill chunks that a captured graph replays


# A tail longer than this stays a chunk: each decode row reads its sequence's whole context
# (adjacent rows of one sequence share those reads through the L2 cache, mostly), where the
# prefill kernel reads it once per query tile. The tail of a request moved here live is the
# tokens its source made while this worker pulled its KV: about (pull time / step time).
MAX_TAIL_ROWS = 32


def _as_decode_rows(batch: ScheduledBatch) -> bool:
    """Whether this step runs as a decode step although some sequences compute several
    tokens: every sequence decodes one token, verifies drafts (engine/spec_decode/), or
    computes a short tail of its outputs, and some do more than one.

    A tail: the KV of a few output tokens the sequence has but never computed here, at most
    MAX_TAIL_ROWS of them, past its prompt (no prompt logprobs among them). A request moved
    here live (engine/migration.py) has one at its HandOver, the tokens its source made after
    lending its KV; so has a forked sample that recomputes its outputs. As a chunk over a long
    context it would take the prefill kernel, which does not split a context between programs
    the way the decode kernel does (a 32k-token context: tens of decode steps' time).

    A verify row of k drafts after its last token at position L, or a tail of 1 + k tokens
    from position L, then becomes 1 + k decode rows on the sequence's block table, row i at
    position L + i with a context of L + i + 1:

        position  0 .. L-1 | L    L+1  L+2  L+3
        row 0     context  | q                     context L + 1
        row 1     context  | k    q                context L + 2
        row 2     context  | k    k    q           context L + 3
        row 3     context  | k    k    k    q      context L + 4

    Every row's KV is stored before any row attends (as in every step), so row i reads the
    tokens before it from the pool; each row ends up with exactly the keys and the causal
    mask the chunk's query i has. The flattened token order is the chunk's, so the sampled
    rows' indices mean what they meant. Such a step runs through the decode attention kernel
    and replays the decode CUDA graph of its row count, where a chunk would take the prefill
    kernel and a mixed-step graph; a step with prompt chunks as well stays a mixed step."""
    several = False
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if n > 1:
            start = seq.num_computed_tokens
            if seq.spec_token_ids:  # a verify row: its drafts after its last token
                if start + n <= len(seq.token_ids):
                    return False
            elif n > MAX_TAIL_ROWS or start < seq.num_prompt_tokens:
                return False
            several = True
    return several


def _to(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
