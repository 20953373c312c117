"""Would a mixed step gain from running its decode attention beside its GEMMs? (NanoFlow-style
overlap, measured before building it.)

A step carrying a prompt chunk of P tokens and D decodes at C tokens of context runs, in each of
the model's layers, the merged q/k/v projection over all P + D rows, the prefill attention of
the chunk, the decode attention of the D sequences (memory-bound: their KV), then o_proj,
gate_up, SiLU-and-mul and down over all rows (compute-bound at a few hundred rows). Every
variant below runs those kernels for all 32 layers of the Llama-3.1-8B shapes (bf16, each
layer its own weights and KV, so nothing is served from the L2), captured in one CUDA graph
and replayed back to back, as the engine's steps run; norms, rotary and the residual adds are
left out (~0.6 ms of a 9 ms step, the same in every variant):

  serial       today's order: one GEMM per projection over all rows, the two attentions after
               the q/k/v GEMM, one stream;
  split        the rows after attention in two groups (the chunk's P, the decodes' D), each
               group's o_proj / gate_up / down GEMMs of their own: what splitting costs, one
               stream (each group's GEMMs read the weights again);
  overlap      split, the decode attention on a second stream beside the chunk's prefill
               attention and its o_proj / MLP GEMMs, the decodes' GEMMs after both;
  overlap-hi   overlap with the second stream at high priority (its programs are scheduled as
               the GEMMs' programs retire);
  bound        no dependencies: all of serial's GEMMs on one stream, all its attention on
               another, joined at the end: the most any overlap of the two could save.
  gemms, attn  serial's GEMMs alone, its attention alone (one stream each).

    python benchmarks/kernels/overlap.py [--shapes 144+112@448 1536+512@320] [--out o.json]
    python benchmarks/kernels/overlap.py --smoke          # CPU, the interpreter, eagerly

Each row: ms a step (32 layers) and the ratio to serial; the decode attention's split count is
the engine's (decode_num_splits).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.paged_kernels_cases import PrefillInputs, make_prefill_inputs
from benchmarks.kernels.paged_kernels_common import LLAMA_8B, SMOKE, Shape, bench, sweep_device
from benchmarks.kernels.paged_kernels_decode import DecodeInputs, make_decode_inputs
from tandem.kernels import paged_decode_attention
from tandem.kernels._common import num_sms
from tandem.kernels.paged_decode_launch import (
    decode_config,
    decode_num_splits,
    decode_workspace_numel,
)

VARIANTS = ("serial", "split", "overlap", "overlap-hi", "bound", "gemms", "attn")


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    num_layers: int


LLAMA_8B_DIMS = Dims(4096, 14336, 32)
SMOKE_DIMS = Dims(64, 128, 2)


@dataclass
class LayerWeights:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class Step:
    """One mixed step's kernels over every layer: inputs, weights and the variants' call orders."""

    def __init__(self, prompt: int, decodes: int, context: int, shape: Shape, dims: Dims,
                 block_size: int, device: torch.device) -> None:
        self.prompt, self.decodes, self.context = prompt, decodes, context
        rows, hd = prompt + decodes, shape.head_dim
        q_dim, kv_dim = shape.num_q_heads * hd, shape.num_kv_heads * hd
        dt = shape.dtype

        def w(out_dim: int, in_dim: int) -> torch.Tensor:
            return torch.randn(out_dim, in_dim, dtype=dt, device=device) * in_dim ** -0.5

        self.layers = [LayerWeights(w(q_dim + 2 * kv_dim, dims.hidden), w(dims.hidden, q_dim),
                                    w(2 * dims.intermediate, dims.hidden),
                                    w(dims.hidden, dims.intermediate))
                       for _ in range(dims.num_layers)]
        self.x = torch.randn(rows, dims.hidden, dtype=dt, device=device)
        self.attn_out = torch.randn(rows, q_dim, dtype=dt, device=device)
        self.prefill: list[PrefillInputs] = [
            make_prefill_inputs(1, prompt, 0, shape, block_size, device)
            for _ in range(dims.num_layers)] if prompt else []
        self.decode: DecodeInputs | None = make_decode_inputs(
            decodes, context, shape, block_size, dims.num_layers, device,
            contiguous=False) if decodes else None
        self.splits = decode_num_splits(decodes, shape.num_kv_heads, context, num_sms(device),
                                        decode_config(hd).block_n) if decodes else 1
        self.ws = torch.empty(decode_workspace_numel(max(decodes, 1), shape.num_q_heads, hd,
                                                     self.splits), dtype=torch.float32,
                              device=device)
        self.counters = torch.zeros(max(decodes, 1) * shape.num_kv_heads, dtype=torch.int32,
                                    device=device)
        self.scale = hd ** -0.5
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.side_hi = (torch.cuda.Stream(device, priority=-1) if device.type == "cuda"
                        else None)

    # ---------------------------------------------------------------- the kernels of a layer

    def qkv(self, i: int) -> torch.Tensor:
        return F.linear(self.x, self.layers[i].qkv)

    def prefill_attn(self, i: int) -> None:
        if self.prompt:
            self.prefill[i].call()()

    def decode_attn(self, i: int) -> None:
        d = self.decode
        if d is None:
            return
        paged_decode_attention(d.q, d.pool[:, i, 0], d.pool[:, i, 1], d.block_tables,
                               d.seq_lens, self.scale, out=d.out, max_seq_len=self.context,
                               workspace=self.ws, counters=self.counters)

    def after_attn(self, i: int, rows: slice) -> torch.Tensor:
        """o_proj, gate_up, SiLU-and-mul, down over `rows`."""
        lw = self.layers[i]
        h = F.linear(self.attn_out[rows], lw.o)
        gu = F.linear(h, lw.gate_up)
        g, u = gu.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, lw.down)

    # ---------------------------------------------------------------- the variants

    def _fork(self, stream: torch.cuda.Stream | None, fn: Callable[[], None]) -> None:
        if stream is None:  # the CPU: in order
            fn()
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()

    def _join(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)

    def call(self, variant: str) -> Callable[[], None]:
        n = len(self.layers)
        chunk, dec = slice(0, self.prompt), slice(self.prompt, self.prompt + self.decodes)
        everything = slice(0, self.prompt + self.decodes)

        def in_order(groups: tuple[slice, ...]) -> Callable[[], None]:
            """Each layer in turn, its rows after attention in `groups`."""
            def run() -> None:
                for i in range(n):
                    self.qkv(i)
                    self.prefill_attn(i)
                    self.decode_attn(i)
                    for rows in groups:
                        self.after_attn(i, rows)
            return run

        def overlap(stream: torch.cuda.Stream | None) -> Callable[[], None]:
            def run() -> None:
                for i in range(n):
                    self.qkv(i)
                    self._fork(stream, lambda i=i: self.decode_attn(i))
                    self.prefill_attn(i)
                    self.after_attn(i, chunk)
                    self._join(stream)
                    self.after_attn(i, dec)
            return run

        def bound() -> None:
            self._fork(self.side, lambda: [(self.prefill_attn(i), self.decode_attn(i))
                                           for i in range(n)])
            for i in range(n):
                self.qkv(i)
                self.after_attn(i, everything)
            self._join(self.side)

        def gemms() -> None:
            for i in range(n):
                self.qkv(i)
                self.after_attn(i, everything)

        def attn() -> None:
            for i in range(n):
                self.prefill_attn(i)
                self.decode_attn(i)

        return {"serial": in_order((everything,)), "split": in_order((chunk, dec)),
                "overlap": overlap(self.side),
                "overlap-hi": overlap(self.side_hi), "bound": bound, "gemms": gemms,
                "attn": attn}[variant]


def parse_shape(s: str) -> tuple[int, int, int]:
    """'P+D@C': P prompt tokens, D decodes at C tokens of context."""
    try:
        rows, context = s.split("@")
        prompt, decodes = rows.split("+")
        return int(prompt), int(decodes), int(context)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {s!r}: expected P+D@C, e.g. 144+112@448") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=parse_shape,
                   default=[(144, 112, 448), (256, 192, 448), (1536, 512, 320)])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device, card = sweep_device()
    shape, dims = (SMOKE, SMOKE_DIMS) if args.smoke else (LLAMA_8B, LLAMA_8B_DIMS)
    if args.smoke:
        args.shapes, args.reps = [(24, 6, 40)], 1
    rows = []
    for prompt, decodes, context in args.shapes:
        step = Step(prompt, decodes, context, shape, dims, args.block_size, device)
        ms = {v: bench([step.call(v)], device, args.reps, min_calls=1) * 1e3 for v in VARIANTS}
        rows.append({"prompt": prompt, "decodes": decodes, "context": context,
                     "splits": step.splits, "ms": ms})
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"card": card, "layers": dims.num_layers, "rows": rows},
                                       indent=1))
    print(f"# {card}: {dims.num_layers} layers of a mixed step's GEMMs and attention, ms a step "
          "(× serial)")
    print(f"{'prompt + decodes @ context':<28}" + "".join(f"{v:>18}" for v in VARIANTS))
    for r in rows:
        base = r["ms"]["serial"]
        label = f"{r['prompt']} + {r['decodes']} @ {r['context']}"
        print(f"{label:<28}" + "".join(f"{r['ms'][v]:>10.3f} ({r['ms'][v] / base:4.2f})"
                                       for v in VARIANTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
