"""Steps replayed from CUDA graphs: decode steps (CudaGraphRunner) and steps with prefill chunks
(MixedGraphRunner).

A decode step's work is fixed by its batch size, so one graph per size on a ladder
(1, 2, 4, 8, 16, 24, ... max) replays the whole forward pass, the LM head and the greedy argmax
with one launch instead of a few hundred. A batch of B runs in the smallest captured size >= B; the padding rows have slot -1
(nothing stored) and context 0 (nothing read), unless a larger graph runs its projections
clearly faster: the GEMM library's kernels for some row counts are slower than for a few more
rows (an 8B's four projections on an H200: 10.7 ms over the 32 layers at 400 rows, 9.7 at 408;
benchmarks/kernels/gemm_rows.py), so once the graphs are captured one layer's projections are
timed at each size from MIN_TIMED_ROWS (`projection_times`) and a size is sent on to the
cheapest larger one that beats it by PICK_MARGIN (`cheaper_sizes`).

Inputs live in static buffers that every graph reads:

    input_ids [max_bs]  positions [max_bs]  slot_mapping [max_bs]  seq_lens [max_bs]
    block_tables [max_bs, max_blocks_per_seq]   ─▶ graph ─▶  logits [bs, vocab] fp32, argmax [bs]

and every graph writes its logits into one static buffer: outputs that each graph kept for itself
held [bs, vocab] float32 per captured size (8.5 GiB for an 8B model's ladder up to 512).

A step's inputs reach those buffers in one host-to-device copy (`run_step`): the static
buffers are views of one device buffer (int64: token ids, positions, slots, then scratch;
int32: context lengths, then the block table's rows), the host writes the step into a pinned
staging buffer laid out the same way, and one copy moves its prefix up to the last table row
the step's graph reads (while those full rows are few: past DIRECT_TABLE_ENTRIES, rows packed
at the step's width travel apart and a device copy puts them in the table). A decode step at
batch 1 takes a few hundred microseconds of host work, which the device waits for whenever
the host has waited for it first (a speculative verify step, the step after it), and every
torch call costs the host ~10 µs on a GPU box (benchmarks/engine/spec_decode.py latency; a
copy into the table through a device-side copy cost 25). Two staging buffers alternate; each
is rewritten only once the device has read it (an event recorded after its copy).
"""

from __future__ import annotations

import gc
import logging
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
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


# A batch replays a larger graph than its own size only if that one is this much faster: timing
# noise (a few %) never moves a batch, a GEMM picked badly for its row count (tens of %) does.
PICK_MARGIN = 0.05


def cheaper_sizes(sizes: list[int], times: dict[int, float], margin: float = PICK_MARGIN
                  ) -> dict[int, int]:
    """{size: larger size to run instead} for each size whose cheapest larger size (the
    smallest of equals) takes under (1 - margin) of its own time; sizes ascending."""
    remap: dict[int, int] = {}
    best: tuple[float, int] | None = None  # the cheapest size above, with its time
    for s in reversed(sizes):
        t = times[s]
        if best is not None and best[0] < (1 - margin) * t:
            remap[s] = best[1]
        if best is None or t <= best[0]:
            best = (t, s)
    return remap


# Row counts below this are not timed (the projections read their weights at any of them, and
# a step's time barely moves with its rows) and never sent on.
MIN_TIMED_ROWS = 64


@torch.inference_mode()
def projection_times(layer: torch.nn.Module, sizes: list[int], dtype: torch.dtype,
                     device: torch.device, rounds: int = 3) -> dict[int, float]:
    """Seconds one decoder layer's projections (its modules with a 2-D weight: plain, merged
    and FP8 linears) take over each row count in `sizes`, captured in a CUDA graph per size
    as the steps' graphs run them, the median of `rounds` rounds of replays after one to
    warm up. A graph's size changes these and little else: the attention and the rest of a
    step scale with the step's real rows. One device only (a tensor-parallel projection
    all-reduces)."""
    projs = [m for m in layer.modules()
             if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]
    x = {k: torch.randn(max(sizes), k, dtype=dtype, device=device)
         for k in {m.weight.shape[1] for m in projs}}

    def run(rows: int) -> None:
        for m in projs:
            m(x[m.weight.shape[1]][:rows])

    graphs, pool = {}, None
    for s in reversed(sizes):  # largest first: the others reuse its memory
        run(s)
        torch.cuda.synchronize()
        graphs[s] = torch.cuda.CUDAGraph()
        with capturing(graphs[s], pool):
            run(s)
        pool = pool or graphs[s].pool()
    marks: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {s: [] for s in sizes}
    for r in range(rounds + 1):
        for s in sizes:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            graphs[s].replay()
            end.record()
            if r:
                marks[s].append((start, end))
    torch.cuda.synchronize()
    for g in graphs.values():
        g.reset()
    return {s: statistics.median(a.elapsed_time(b) for a, b in marks[s]) / 1e3 for s in sizes}


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
        self.width = max_blocks_per_seq
        self.sizes = batch_size_ladder(max_bs)
        mb, width = max_bs, max_blocks_per_seq
        # One device buffer, viewed as int64 [5 * max_bs] (ids, positions, slots, then a
        # pipelined step's placeholder fills: their rows here, and the previous step's rows
        # they take) and then int32 [max_bs] (context lengths) and [max_bs, width] (the block
        # table), and when full rows can be too many to copy, int32 [max_bs * width] for rows
        # packed at a step's width (`run_step`).
        packed = mb * width > DIRECT_TABLE_ENTRIES
        # The decode kernel's plan (the GPU backend's; kernels/paged_decode_launch.py): a
        # graph of bs rows reads its first plan_capacity(bs) + 1 rows.
        cap = backend.plan_capacity(mb)
        plan_rows = cap + 1 if cap else 0
        self.buf = torch.zeros(8 * 5 * mb + 4 * (mb + 2 * plan_rows + mb * width * (1 + packed)),
                               dtype=torch.uint8, device=device)
        self.longs, self.ints, self.plan, self.block_tables, self.packed = _views(
            self.buf, mb, width, plan_rows)
        if cap:  # no work while capturing
            self.plan.copy_(torch.from_numpy(backend.plan([], cap)))
        self.input_ids = self.longs[:mb]
        self.positions = self.longs[mb:2 * mb]
        self.slot_mapping = self.longs[2 * mb:3 * mb]
        self.slot_mapping.fill_(-1)
        self.seq_lens = self.ints[:mb]
        self.size_for = [next(s for s in self.sizes if s >= b) for b in range(mb + 1)]
        self.remap: dict[int, int] = {}  # sizes replayed at a larger one (use_sizes)
        self.staging = [_Staging(self.buf, mb, width, plan_rows) for _ in range(2)]
        self._turn = 0
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        vocab = model.config.vocab_size  # a tensor-parallel LM head holds a slice of it
        self.logits = torch.zeros(max_bs, vocab, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Per size: its rows of the logits buffer and its argmax (rewritten by every replay).
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # outputs[:b], by b
        self.pool = None
        self.replays = 0  # steps run from a graph (tests check the graphs ran)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            max_query_len=1, max_seq_len=self.block_tables.shape[1] * self.backend.pool.shape[3],
            query_lens_cpu=[1] * bs, seq_lens_cpu=[0] * bs,
            decode_plan=self.plan[:cap + 1] if (cap := self.backend.plan_capacity(bs)) else None)

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

    def pick_sizes(self, layer: torch.nn.Module, dtype: torch.dtype) -> None:
        """Time `layer`'s projections at every size from MIN_TIMED_ROWS and send each batch
        on to the larger graph `cheaper_sizes` names, if any. One device only."""
        timed = [s for s in self.sizes if s >= MIN_TIMED_ROWS]
        if len(timed) > 1:
            self.use_sizes(cheaper_sizes(timed, projection_times(layer, timed, dtype,
                                                                 self.buf.device)))

    def use_sizes(self, remap: dict[int, int]) -> None:
        """Send each batch whose own size `remap` maps on to the larger graph it names."""
        self.remap = dict(remap)
        self.size_for = [remap.get(s, s) for s in self.size_for]
        if remap:
            log.info("decode CUDA graphs replayed at a larger size (faster there): %s", remap)

    def release(self) -> None:
        """Free every captured graph. With tensor parallelism this must come before the process
        group is destroyed: a graph that captured NCCL collectives holds the communicator, and
        destroying it first hangs (pytorch/pytorch#115388)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.rows.clear()
        self.pool = None

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_bs and max_blocks <= self.width

    def run_step(self, token_ids: list[int], positions: list[int], slots: list[int],
                 seq_lens: list[int], block_table: np.ndarray, sample_index: list[int],
                 fill: TokenFill | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of a decode batch given as host lists (block_table: int32
        [B, width]), for the rows `sample_index` picks. `fill`: placeholder token
        ids replaced on the device from the previous step's sampled tokens (as the model
        runner's `_device_inputs` does for other steps).

        The greedy tokens are the graph's output buffer, which the next replay of that graph
        rewrites: whatever reads them (the copy to the host, the next step's fill) is queued
        on this stream before that replay."""
        b = len(token_ids)
        bs = self.size_for[b]
        mb = self.max_bs
        st = self.staging[self._turn]
        self._turn ^= 1
        st.wait()  # the device has read what it held
        longs, ints = st.longs, st.ints
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
        if cap := self.backend.plan_capacity(bs):  # over the graph's rows, the padding's too
            st.plan[:cap + 1] = self.backend.plan(ints[:bs], cap)
        # Columns past the step's width, and padding rows, keep what they held: no row reads
        # past its context. Full rows up to the graph's last make one copy with the rest
        # while they are few; past that, rows packed at the step's width are copied and then
        # put in the table on the device (a long context's rows: 32 KiB each at 128k tokens).
        w = block_table.shape[1]
        if bs * self.width <= DIRECT_TABLE_ENTRIES:
            st.table[:b, :w] = block_table
            dst, src = st.prefix(bs)
            dst.copy_(src, non_blocking=True)
            st.record(self.stream)
        else:
            n = b * w
            st.packed[:n] = block_table.reshape(-1)
            dst, src = st.prefix(0)
            dst.copy_(src, non_blocking=True)
            self.packed[:n].copy_(st.packed_tensor[:n], non_blocking=True)
            st.record(self.stream)
            self.block_tables[:b, :w].copy_(self.packed[:n].view(b, w))
        if k:  # stream order: the previous step's sampling ran before this gather
            self.input_ids.index_copy_(0, self.longs[3 * mb:3 * mb + k], fill.tokens.index_select(
                0, self.longs[4 * mb:4 * mb + k]))
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
            out = self.rows.get(b)
            if out is None:  # views of the graph's outputs, sliced once per batch size
                logits, greedy = self.outputs[bs]
                out = self.rows[b] = (logits[:b], greedy[:b])
        else:  # not captured (tests on the CPU): the same step, run eagerly
            logits, greedy = self._forward(bs)
            out = (logits[:b], greedy[:b])
        self.replays += 1
        logits, greedy = out
        if len(sample_index) != b or sample_index != list(range(b)):  # a fork samples n times
            index = torch.tensor(sample_index, dtype=torch.long).to(self.longs.device)
            logits, greedy = logits[index], greedy[index]
        return logits, greedy


# Block-table entries a decode step's one copy may carry as full rows (rows up to its graph's
# size, each max_blocks_per_seq wide): 256 KiB, a few microseconds over PCIe.
DIRECT_TABLE_ENTRIES = 64 * 1024


def _views(buf: torch.Tensor, mb: int, width: int, plan_rows: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CudaGraphRunner's buffer (bytes) as its int64 part, its int32 part, the decode plan
    (int32 [plan_rows, 2] after the context lengths; empty without one), the block table after
    it and the packed rows' space after that (empty when there is none)."""
    n = 8 * 5 * mb
    ints = buf[n:].view(torch.int32)
    t = mb + 2 * plan_rows
    return (buf[:n].view(torch.long), ints, ints[mb:t].view(plan_rows, 2),
            ints[t:t + mb * width].view(mb, width), ints[t + mb * width:])


class _Staging:
    """A pinned host copy of CudaGraphRunner's input buffer (plain memory on the CPU), its
    parts as numpy arrays, and the event recorded after the copy that read it."""

    def __init__(self, buf: torch.Tensor, mb: int, width: int, plan_rows: int) -> None:
        pin = buf.is_cuda
        self.buf = torch.zeros(buf.shape, dtype=buf.dtype, pin_memory=pin)
        longs, ints, plan, table, self.packed_tensor = _views(self.buf, mb, width, plan_rows)
        self.longs, self.ints, self.table = longs.numpy(), ints.numpy(), table.numpy()
        self.plan = plan.numpy()
        self.packed = self.packed_tensor.numpy()
        self.device_buf = buf
        self.row_bytes = 4 * width
        # the int64 part, the context lengths and the plan
        self.head_bytes = 8 * 5 * mb + 4 * (mb + 2 * plan_rows)
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.event = torch.cuda.Event() if pin else None
        self.recorded = False

    def prefix(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device buffer's and this copy's bytes that a step of `bs` rows reads: up to
        its last block-table row (sliced once per size: a slice costs microseconds); bs 0:
        the ids, positions, slots and context lengths only."""
        pair = self.copies.get(bs)
        if pair is None:
            n = self.head_bytes + bs * self.row_bytes
            pair = self.copies[bs] = (self.device_buf[:n], self.buf[:n])
        return pair

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
        # The decode kernel's plan over the graph's sequence rows (model_runner builds it
        # padded to plan_capacity(S) + 1 rows); no work while capturing.
        cap = backend.plan_capacity(s)
        self.plan = torch.from_numpy(backend.plan([], cap)).to(device) if cap else \
            torch.zeros(0, 2, **ints)
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
            prefill_tiles=self.tiles[:self.capacity(t)], decode_lens=self.decode_lens[:s],
            decode_plan=self.plan[:cap + 1] if (cap := self.backend.plan_capacity(s)) else None)

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
        if meta.decode_plan is not None:
            self.plan[:meta.decode_plan.shape[0]].copy_(meta.decode_plan)
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
