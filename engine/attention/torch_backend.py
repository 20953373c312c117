"""Plain-torch paged attention: the CPU backend and the reference the Triton backend is tested
against. One sequence at a time; correctness over speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine import ops
from tandem.engine.attention.base import AttentionBackend, AttentionMetadata, Rope
from tandem.engine.quantization.kv_cache import dequantize_kv, quantize_kv

Scale = torch.Tensor | None  # an FP8 cache's per-KV-head scales, fp32 [H]; None otherwise


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: Scale = None,
                   v_scale: Scale = None) -> None:
    """Write k, v [T, H, D] into their slots of the paged caches [N, bs, H, D] (strided ok),
    quantized with the scales for an FP8 cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    blocks, offsets = slots // bs, slots % bs
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x[keep]
        cache[blocks, offsets] = quantize_kv(x, scale) if scale is not None else x.to(cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence's paged cache, as [seq_len, H, D]."""
    bs = cache.shape[1]
    nblocks = -(seq_len // -bs)
    return cache[block_table[:nblocks].long()].reshape(nblocks * bs, *cache.shape[2:])[:seq_len]


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_lens: list[int],
                          seq_lens: list[int], scale: float, k_scale: Scale = None,
                          v_scale: Scale = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    q: [T, Hq, D] packed in sequence order; the new tokens of sequence b are the last
    query_lens[b] of its seq_lens[b] context tokens.
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    start = 0
    for b, (qlen, slen) in enumerate(zip(query_lens, seq_lens, strict=True)):
        qs = q[start:start + qlen].transpose(0, 1)  # [Hq, qlen, D]
        ks = dequantize_kv(gather_context(k_cache, block_tables[b], slen), k_scale,
                           q.dtype).transpose(0, 1)
        vs = dequantize_kv(gather_context(v_cache, block_tables[b], slen), v_scale,
                           q.dtype).transpose(0, 1)
        if hq != hkv:
            ks = ks.repeat_interleave(hq // hkv, dim=0)
            vs = vs.repeat_interleave(hq // hkv, dim=0)
        # Query i sits at position slen - qlen + i and sees keys 0 ..= that position.
        qpos = torch.arange(slen - qlen, slen, device=q.device)
        mask = torch.arange(slen, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start:start + qlen] = o.transpose(0, 1)
        start += qlen
    return out


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                       scale: float, k_scale: Scale = None, v_scale: Scale = None
                       ) -> torch.Tensor:
    """One query token per sequence, all sequences in one batched attention: contexts gathered
    to the longest one and masked past each sequence's own length. q: [B, Hq, D]."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    nblocks = -(max_seq_len // -bs)
    tables = block_tables[:, :nblocks].long()
    ks = dequantize_kv(k_cache[tables], k_scale, q.dtype)
    vs = dequantize_kv(v_cache[tables], v_scale, q.dtype)
    ks = ks.reshape(b, nblocks * bs, hkv, d)[:, :max_seq_len].transpose(1, 2)
    vs = vs.reshape(b, nblocks * bs, hkv, d)[:, :max_seq_len].transpose(1, 2)
    if hq != hkv:
        ks = ks.repeat_interleave(hq // hkv, dim=1)
        vs = vs.repeat_interleave(hq // hkv, dim=1)
    mask = torch.arange(max_seq_len, device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], ks, vs,
                                         attn_mask=mask[:, None, None, :], scale=scale)
    return out[:, :, 0, :]


class TorchAttentionBackend(AttentionBackend):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        k_scale, v_scale = self.kv_scale(layer)
        if rope is not None:  # ops: Hugging Face's arithmetic on the CPU, Triton on CUDA
            ops.rotary_embedding(rope.positions, q, k, rope.cos_sin_cache)
        store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if meta.num_decodes == meta.num_seqs > 1:  # a decode batch: one batched call
            return paged_decode_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, self.scale, k_scale, v_scale)
        return paged_attention_torch(q, k_cache, v_cache, meta.block_tables,
                                     meta.query_lens_cpu, meta.seq_lens_cpu, self.scale,
                                     k_scale, v_scale)
