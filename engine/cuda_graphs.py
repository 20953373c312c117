"""Decode steps replayed from CUDA graphs.

A decode step's work is fixed by its batch size, so one graph per size on a ladder
(1, 2, 4, 8, 16, 24, ... max) replays the whole forward pass, the LM head and the greedy argmax
with one launch instead of a few hundred. A batch of B runs in the smallest captured size >= B; the padding rows have slot -1
(nothing stored) and context 0 (nothing read).

Inputs live in static buffers that every graph reads:

    input_ids [max_bs]  positions [max_bs]  slot_mapping [max_bs]  seq_lens [max_bs]
    block_tables [max_bs, max_blocks_per_seq]   ─▶ graph ─▶  logits [bs, vocab] fp32, argmax [bs]

and every graph writes its logits into one static buffer: outputs that each graph kept for itself
held [bs, vocab] float32 per captured size (8.5 GiB for an 8B model's ladder up to 512).
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, forward_context

log = logging.getLogger(__name__)


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
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
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
            with torch.cuda.graph(graph, pool=self.pool), forward_context(self.backend, meta):
                hidden = self.model(self.input_ids[:bs], self.positions[:bs])
                logits = self.model.compute_logits(hidden, out=self.logits[:bs])
                self.outputs[bs] = (logits, logits.argmax(dim=-1))
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

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and greedy tokens of a decode batch (inputs already on the device)."""
        b = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(slot_mapping)
        self.seq_lens[:b].copy_(seq_lens)
        width = block_tables.shape[1]
        self.block_tables[:b, :width].copy_(block_tables)
        if bs > b:  # padding rows: store nothing, read nothing
            self.slot_mapping[b:bs].fill_(-1)
            self.seq_lens[b:bs].zero_()
        self.graphs[bs].replay()
        self.replays += 1
        logits, greedy = self.outputs[bs]
        return logits[:b], greedy[:b]
