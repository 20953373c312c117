"""Steps replayed from CUDA graphs: decode steps (CudaGraphRunner) and steps with prefill chunks
(MixedGraphRunner).

A decode step's work is fixed by its batch size, so one graph per size on a ladder
(1, 2, 4, 8, 16, 24, ... max) replays the whole forward pass, the LM head and the greedy argmax
with one launch instead of a few hundred. A batch of B runs in the smallest captured size >= B; the padding rows have slot -1
(nothing stored) and context 0 (nothing read).

Inputs live in static buffers that every graph reads:

    input_ids [max_bs]  positions [max_bs]  slot_mapping [max_bs]  seq_lens [max_bs]
    block_tables [max_bs, max_blocks_per_seq]   ─▶ graph ─▶  logits [bs, vocab] fp32, argmax [bs]

and every graph writes its logits into one static buffer: outputs that each graph kept for itself
held [bs, vocab] float32 per captured size (8.5 GiB for an 8B model's ladder up to 512).

A step's inputs reach those buffers in two host-to-device copies (`run_step`): the host writes
them into a pinned staging buffer laid out like two device buffers that the static ones are
views of (int64: token ids, positions, slots, then scratch; int32: context lengths, then the
block table's rows packed at their width), one copy each, then one device copy puts the packed
rows into the table. A decode step at batch 1 takes a few hundred microseconds of host work,
which the device waits for whenever the host has waited for it first (a speculative verify
step, the step after it): three pinned tensors, three copies and five device copies per step
were most of that (benchmarks/engine/spec_decode.py latency). Two staging buffers alternate;
each is rewritten only once the device has read it (an event recorded after its copies).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tandem.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    forward_context,
    max_prefill_tiles,
)
from tandem.engine.step_tokens import TokenFill

log = logging.getLogger(__name__)


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """torch.cuda.graph with Python's garbage collector off while it captures (it collects
    once on entering). A collection inside the capture can finalize an engine dropped earlier
    in the process whose CUDA graphs were never reset (a reference cycle holds them): the
    graph's reset is not permitted while a stream captures, and it invalidates the capture
    (seen on an H200 in tests/gpu/test_mixed_graphs_gpu.py, one engine after another)."""
    enabled = gc.isenabled()
    with torch.cuda.graph(graph, pool=pool):
        gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b <= max_bs]
    sizes += list(range(8, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_bs: int,
                 max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.max_bs = max_bs
        self.sizes = batch_size_ladder(max_bs)
        mb, width = max_bs, max_blocks_per_seq
        # int64: ids, positions, slots, then a pipelined step's placeholder fills (their rows
        # here, and the previous step's rows they take: max_bs each); int32: context lengths
        # [max_bs], then the block table's rows packed at the step's width.
        self.longs = torch.zeros(5 * mb, dtype=torch.long, device=device)
        self.ints = torch.zeros(mb + mb * width, dtype=torch.int32, device=device)
        self.input_ids = self.longs[:mb]
        self.positions = self.longs[mb:2 * mb]
        self.slot_mapping = self.longs[2 * mb:3 * mb]
        self.slot_mapping.fill_(-1)
        self.seq_lens = self.ints[:mb]
        self.block_tables = torch.zeros(mb, width, dtype=torch.int32, device=device)
        self.staging = [_Staging(self.longs, self.ints) for _ in range(2)]
        self._turn = 0
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        vocab = model.config.vocab_size  # a tensor-parallel LM head holds a slice of it
        self.logits = torch.zeros(max_bs, vocab, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per size: its rows of the logits buffer and its argmax (rewritten by every replay).
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0  # steps run from a graph (tests check the graphs ran)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            max_query_len=1, max_seq_len=self.block_tables.shape[1] * self.backend.pool.shape[3],
            query_lens_cpu=[1] * bs, seq_lens_cpu=[0] * bs)

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        with forward_context(self.backend, self._meta(bs)):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            logits = self.model.compute_logits(hidden, out=self.logits[:bs])
            return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture largest first, so smaller graphs reuse the largest one's memory pool."""
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            # Warm up outside the capture: Triton compiles and picks its configs here.
            with forward_context(self.backend, meta):
                self.model(self.input_ids[:bs], self.positions[:bs])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                self.outputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def release(self) -> None:
        """Free every captured graph. With tensor parallelism this must come before the process
        group is destroyed: a graph that captured NCCL collectives holds the communicator, and
        destroying it first hangs (pytorch/pytorch#115388)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_bs and max_blocks <= self.block_tables.shape[1]

    def run_step(self, token_ids: list[int], positions: list[int], slots: list[int],
                 seq_lens: list[int], block_table: torch.Tensor, sample_index: list[int],
                 fill: TokenFill | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of a decode batch given as host lists (block_table: int32
        [B, width] on the CPU), for the rows `sample_index` picks. `fill`: placeholder token
        ids replaced on the device from the previous step's sampled tokens (as the model
        runner's `_device_inputs` does for other steps)."""
        b = len(token_ids)
        bs = next(s for s in self.sizes if s >= b)
        mb = self.max_bs
        st = self.staging[self._turn]
        self._turn ^= 1
        st.wait()  # the device has read what it held
        longs, ints = st.longs_np, st.ints_np
        longs[:b] = token_ids
        longs[b:bs] = 0  # padding rows: any valid id, no slot (nothing stored), context 0
        longs[mb:mb + b] = positions
        longs[2 * mb:2 * mb + b] = slots
        longs[2 * mb + b:2 * mb + bs] = -1
        k = len(fill.dst) if fill else 0
        if k:
            longs[3 * mb:3 * mb + k] = fill.dst
            longs[4 * mb:4 * mb + k] = fill.src
        ints[:b] = seq_lens
        ints[b:bs] = 0
        width = block_table.shape[1]
        ints[mb:mb + b * width] = block_table.numpy().reshape(-1)
        n = 4 * mb + k if k else 3 * mb
        self.longs[:n].copy_(st.longs[:n], non_blocking=True)
        self.ints[:mb + b * width].copy_(st.ints[:mb + b * width], non_blocking=True)
        st.record(self.stream)
        self.block_tables[:b, :width].copy_(self.ints[mb:mb + b * width].view(b, width))
        if k:  # stream order: the previous step's sampling ran before this gather
            self.input_ids.index_copy_(0, self.longs[3 * mb:3 * mb + k], fill.tokens.index_select(
                0, self.longs[4 * mb:4 * mb + k]))
        graph = self.graphs.get(bs)
        if graph is None:  # not captured (tests on the CPU): the same step, run eagerly
            self.outputs[bs] = self._forward(bs)
        else:
            graph.replay()
        self.replays += 1
        logits, greedy = self.outputs[bs][0][:b], self.outputs[bs][1][:b]
        if len(sample_index) != b or sample_index != list(range(b)):  # a fork samples n times
            index = torch.tensor(sample_index, dtype=torch.long).to(self.longs.device)
            logits, greedy = logits[index], greedy[index]
        return logits, greedy


class _Staging:
    """A pinned host copy of CudaGraphRunner's two input buffers (plain memory on the CPU) and
    the event recorded after the copies that read it."""

    def __init__(self, longs: torch.Tensor, ints: torch.Tensor) -> None:
        pin = longs.is_cuda
        self.longs = torch.zeros(longs.shape, dtype=longs.dtype, pin_memory=pin)
        self.ints = torch.zeros(ints.shape, dtype=ints.dtype, pin_memory=pin)
        self.longs_np, self.ints_np = self.longs.numpy(), self.ints.numpy()
        self.event = torch.cuda.Event() if pin else None
        self.recorded = False

    def wait(self) -> None:
        if self.recorded:
            self.event.synchronize()

    def record(self, stream) -> None:
        if self.event is not None:
            self.event.record(stream)
            self.recorded = True


# Token counts of the mixed-step graphs; a step of T tokens replays the smallest >= T. Above
# the largest, steps run eagerly: their GPU time (~35 ms for 2,048 tokens of an 8B model on an
# H200) already hides the host's launches.
MIXED_SIZES = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


class MixedGraphRunner:
    """Steps with prefill chunks (chunks alone, or beside decodes) replayed from CUDA graphs.

    An eager step costs the host a few hundred kernel launches, 30-50 ms on a GPU box's CPU
    for an 8B model (benchmarks/engine/step_profile.py --host-profile): more than the GPU time of a
    step of a few hundred tokens, which then waits on its launches. One graph per token count
    on MIXED_SIZES replays the forward pass, the LM head over the rows that sample and their
    argmax. What makes a step's shape fixed: the decode kernel runs over all S sequence rows,
    with a context of 0 (zeros written, nothing read) except for the decodes, which come
    first; then the prefill kernel runs the chunks from its work list (sequence, query tile),
    whose capacity depends only on the token count, and overwrites their rows. Padding tokens
    store nothing (slot -1) and belong to no work item; sampled rows beyond the step's read
    row 0 and are dropped.

        input_ids, positions, slot_mapping [T]   query_start_loc [S + 1]  seq_lens [S]
        decode_lens [S]   block_tables [S, max_blocks]   tiles [cdiv(T, block_q) + S, 2]
        sample_index [S]  ─▶ graph ─▶  logits [S, vocab] fp32, argmax [S]
                                                            (S = min(T, max_seqs))
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_tokens: int,
                 max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.block_q = backend.prefill_block_q
        self.sizes = [t for t in MIXED_SIZES if t < max_tokens] + [min(max_tokens, MIXED_SIZES[-1])]
        self.max_seqs = max_seqs
        t, s = self.sizes[-1], self.seqs(self.sizes[-1])
        longs = dict(dtype=torch.long, device=device)
        ints = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(t, **longs)
        self.positions = torch.zeros(t, **longs)
        self.slot_mapping = torch.full((t,), -1, **longs)
        self.sample_index = torch.zeros(s, **longs)
        self.query_start_loc = torch.zeros(s + 1, **ints)
        self.seq_lens = torch.zeros(s, **ints)
        self.decode_lens = torch.zeros(s, **ints)
        self.block_tables = torch.zeros(s, max_blocks_per_seq, **ints)
        self.tiles = torch.full((self.capacity(t), 2), -1, **ints)
        self.logits = torch.zeros(s, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0

    def seqs(self, tokens: int) -> int:
        """Sequences a step of `tokens` tokens can have."""
        return min(tokens, self.max_seqs)

    def capacity(self, tokens: int) -> int:
        return max_prefill_tiles(tokens, self.seqs(tokens), self.block_q)

    def _meta(self, t: int) -> AttentionMetadata:
        s = self.seqs(t)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=self.query_start_loc[:s + 1],
            seq_lens=self.seq_lens[:s], block_tables=self.block_tables[:s], num_decodes=0,
            max_query_len=t, max_seq_len=self.block_tables.shape[1] * self.backend.pool.shape[3],
            query_lens_cpu=[t], seq_lens_cpu=[0] * s,
            prefill_tiles=self.tiles[:self.capacity(t)], decode_lens=self.decode_lens[:s])

    def _forward(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seqs(t)
        with forward_context(self.backend, self._meta(t)):
            hidden = self.model(self.input_ids[:t], self.positions[:t])
        logits = self.model.compute_logits(hidden[self.sample_index[:s]], out=self.logits[:s])
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so smaller graphs reuse the largest one's memory pool. The buffers
        hold no work (every item unused, every slot -1) while capturing."""
        for t in reversed(self.sizes):
            self._forward(t)  # outside the capture: Triton compiles and picks configs here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                self.outputs[t] = self._forward(t)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[t] = graph
        torch.cuda.synchronize()
        log.info("captured mixed-step CUDA graphs for token counts %s", self.sizes)

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def size_for(self, num_tokens: int, num_rows: int) -> int | None:
        """The graph a step of num_tokens tokens over sequences and sampled rows (each at most
        num_rows of them) replays: the smallest with room for both; None: none has."""
        return next((t for t in self.sizes if t >= num_tokens and self.seqs(t) >= num_rows),
                    None)

    def can_run(self, num_tokens: int, num_seqs: int, num_rows: int, max_blocks: int) -> bool:
        return (self.size_for(num_tokens, max(num_seqs, num_rows)) is not None
                and max_blocks <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sample_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of the rows `sample_index` picks, for the step `meta`
        describes (inputs already on the device): its first num_decodes sequences decode,
        and meta.prefill_tiles lists the others' work items, counted from sequence 0."""
        t, s, r = input_ids.shape[0], meta.seq_lens.shape[0], sample_index.shape[0]
        size = self.size_for(t, max(s, r))
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        if size > t:
            self.slot_mapping[t:size].fill_(-1)
        self.query_start_loc[:s + 1].copy_(meta.query_start_loc)
        self.seq_lens[:s].copy_(meta.seq_lens)
        nd = meta.num_decodes
        self.decode_lens[:nd].copy_(meta.seq_lens[:nd])
        self.decode_lens[nd:self.seqs(size)].zero_()
        self.block_tables[:s, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        n = meta.prefill_tiles.shape[0]
        self.tiles[:n].copy_(meta.prefill_tiles)
        self.tiles[n:self.capacity(size), 0].fill_(-1)
        self.sample_index[:r].copy_(sample_index)
        self.sample_index[r:self.seqs(size)].zero_()  # rows of an earlier, larger step
        graph = self.graphs.get(size)
        if graph is None:  # not captured (tests on the CPU): the same step, run eagerly
            self.outputs[size] = self._forward(size)
        else:
            graph.replay()
        self.replays += 1
        logits, greedy = self.outputs[size]
        return logits[:r], greedy[:r]
