from __future__ import annotations

import pytest
import torch

from tandem.kernels import (
    SplitPolicy,
    decode_num_splits,
    decode_workspace_numel,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_launch,
)
from tandem.kernels._common import INTERPRET
from tandem.kernels.paged_decode_launch import (
    PLAN_MIN_SPLIT_TOKENS,
    DecodeConfig,
    decode_plan,
    decode_plan_capacity,
    decode_split_len,
    fullest_last_wave,
)

# Splits of one tile are allowed, so that short contexts exercise the split path.
ANY_SPLIT = SplitPolicy(min_split_tokens=1)
SMALL_TILES = DecodeConfig(block_n=16, num_warps=4, num_stages=2)


def _random_lens(num_seqs: int, max_len: int) -> list[int]:
    lens = torch.randint(1, max_len + 1, (num_seqs,)).tolist()
    lens[torch.randint(0, num_seqs, ()).item()] = max_len  # the long one
    return lens


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_reference(seed, device, make_paged_context, group, head_dim, num_splits):
    block_size = [8, 16, 32][seed % 3]
    num_kv_heads = 2
    lens = [*_random_lens(3, 150), 0]  # plus a padding row (seq_len 0)
    pool, tables, seq_lens = make_paged_context(lens, 64, block_size, 3, 1, num_kv_heads, head_dim,
                                           torch.float32, device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out=out,
                           num_splits=num_splits, policy=ANY_SPLIT)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale)
    msg = f"seed={seed} block_size={block_size} lens={lens}"
    assert num_splits == 1 or -(150 // -decode_split_len(150, num_splits, 64, 1)) == 3, msg
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{msg}\n{m}")
    assert torch.all(out[-1] == 0), msg  # the padding row


def test_short_contexts_with_many_splits(seed, device, make_paged_context):
    """More splits than tiles: the trailing splits are empty and must be ignored."""
    lens = [1, 5, 64, 9]
    pool, tables, seq_lens = make_paged_context(lens, 32, 8, 2, 1, 1, 64, torch.float32, device)
    q = torch.randn(4, 4, 64, device=device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens, 0.125, out=out,
                           num_splits=7, policy=ANY_SPLIT)
    ref = paged_decode_attention_ref(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"seed={seed}\n{m}")


def test_default_split_path_and_workspace(seed, device, make_paged_context):
    """No num_splits: the heuristic picks one; a caller-provided workspace is used."""
    lens = [300, 17]
    pool, tables, seq_lens = make_paged_context(lens, 48, 16, 2, 1, 2, 64, torch.float32, device)
    q = torch.randn(2, 8, 64, device=device)
    splits = decode_num_splits(2, 2, 300, 8, 64)
    assert splits > 1
    ws = torch.full((decode_workspace_numel(2, 8, 64, splits),), float("nan"), device=device)
    out = paged_decode_attention(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens, 0.125,
                                 max_seq_len=300, workspace=ws)
    ref = paged_decode_attention_ref(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"seed={seed}\n{m}")
    assert not torch.isnan(ws).all(), "the split path did not use the workspace"


@pytest.mark.parametrize("group", [1, 4])
def test_planned_launch_matches_reference(seed, device, make_paged_context, group, monkeypatch):
    """A planned launch (the engine's): the long contexts cut into splits of the plan's one
    length, a padding row, unused items at the end; twice over one workspace and counters."""
    # Three short contexts and a long one: a split length of at most 8 tiles of 16 (their
    # total, <= 480 tokens a head over 2 heads, fills 8 programs of 128 tokens), which cuts 300
    # once splits may be as short as 4 of those tiles.
    monkeypatch.setattr(paged_decode_launch, "PLAN_MIN_SPLIT_TOKENS", 64)
    lens = [*_random_lens(3, 60), 300, 0]
    num_kv_heads, head_dim, sms = 2, 64, 1
    pool, tables, seq_lens = make_paged_context(lens, 64, 16, 3, 1, num_kv_heads, head_dim,
                                                torch.float32, device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device)
    capacity = decode_plan_capacity(len(lens), num_kv_heads, sms)
    plan = torch.from_numpy(decode_plan(lens, num_kv_heads, sms, SMALL_TILES.block_n,
                                        capacity)).to(device)
    msg = f"seed={seed} lens={lens} plan={plan[0].tolist()}"
    assert plan[0, 1] > len(lens), msg  # something was split
    ws = torch.full((decode_workspace_numel(capacity, q.shape[1], head_dim, 1),), float("nan"),
                    device=device)
    counters = torch.zeros(len(lens) * num_kv_heads, dtype=torch.int32, device=device)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.125)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, out=out, plan=plan,
                               workspace=ws, counters=counters, config=SMALL_TILES)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{msg}\n{m}")
        assert torch.all(out[-1] == 0), msg
        assert torch.all(counters == 0), msg


def test_decode_plan_covers_every_sequence_within_capacity():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        num_seqs = int(torch.randint(1, 40, (), generator=gen))
        lens = torch.randint(0, 5000, (num_seqs,), generator=gen).tolist()
        if trial % 3 == 0:
            lens[0] = 60000  # one context far above the rest
        heads, sms, block_n = (8, 132, 64) if trial % 2 else (2, 4, 16)
        capacity = decode_plan_capacity(num_seqs, heads, sms)
        plan = decode_plan(lens, heads, sms, block_n, capacity)
        split_len, items = plan[0].tolist()
        pairs = [tuple(row) for row in plan[1:].tolist()]
        assert len(pairs) == capacity and items <= capacity
        assert split_len % block_n == 0 and split_len >= PLAN_MIN_SPLIT_TOKENS
        used, rest = pairs[:items], pairs[items:]
        assert all(p == (-1, 0) for p in rest)
        order = []
        for i, (seq, split) in enumerate(used):  # each sequence's splits 0.. in a row
            if split == 0:
                order.append(seq)
            else:
                assert used[i - 1] == (seq, split - 1)
        assert sorted(order) == list(range(num_seqs))
        assert [lens[s] for s in order] == sorted(lens, reverse=True)  # longest first
        for seq in order:
            n = sum(1 for s, _ in used if s == seq)
            assert n == max(1, -(-lens[seq] // split_len))


def test_split_heuristic():
    sms = 132
    # Plenty of (sequence, KV head) programs: no split.
    assert decode_num_splits(64, 8, 4096, sms) == 1
    assert decode_num_splits(256, 8, 32768, sms) == 1
    # One sequence, long context: split up to about two programs per SM.
    assert decode_num_splits(1, 8, 32768, sms) == 33
    # Short contexts are not cut below 256 tokens (4 tiles of 64; 2 of 128) per split.
    assert decode_num_splits(1, 8, 512, sms) == 2
    assert decode_num_splits(1, 8, 512, sms, block_n=128) == 2
    assert decode_num_splits(1, 8, 100, sms) == 1
    assert 1 <= decode_num_splits(16, 8, 8192, sms) <= 3
    # The policy's knobs (what benchmarks/kernels/decode_ops.py sweeps).
    assert decode_num_splits(1, 8, 1024, sms, policy=SplitPolicy(min_split_tokens=64)) == 16
    assert decode_num_splits(1, 8, 1024, sms, policy=SplitPolicy(min_split_tokens=512)) == 2
    # The minimum is rounded up to whole tiles: 100 tokens is 2 of 64.
    assert decode_num_splits(1, 8, 1024, sms, policy=SplitPolicy(min_split_tokens=100)) == 8
    assert decode_num_splits(1, 8, 32768, sms, policy=SplitPolicy(programs_per_sm=1)) == 17
    assert decode_num_splits(17, 8, 32768, sms, policy=SplitPolicy(programs_per_sm=1)) == 1


def test_unsplit_tiles_fill_the_last_wave():
    """Slots as the three candidates hold them on an H200 (4, 5 and 8 programs an SM of 132):
    the pick is the candidate whose grid fills its last wave best, then the fewest waves."""
    slots = (4 * 132, 5 * 132, 8 * 132)
    assert fullest_last_wave(64 * 8, slots) == 0  # 512 of 528: one full wave
    assert fullest_last_wave(72 * 8, slots) == 1  # 576: 1.09 waves of 528, 0.87 of 660
    # 768: 0.73 of 1,056 in one wave against 1.45 waves of 528, the last half empty
    assert fullest_last_wave(96 * 8, slots) == 2
    assert fullest_last_wave(192 * 8, slots) == 0  # 1,536: 2.91 waves of 528
    assert fullest_last_wave(512 * 8, slots) == 2  # 4,096: 3.88 waves of 1,056, 7.76 of 528
    assert fullest_last_wave(100, slots) == 0  # within one wave: the largest share
    assert fullest_last_wave(700, (300, 300)) == 0  # equals: the first


def test_split_length_in_the_kernel():
    """Each sequence's own length sets its split length: a grid sized for 32k tokens cuts a 1k
    context into 4 splits of 256 (4 tiles), not 33 of one tile."""
    assert decode_split_len(1000, 33, 64, 256) == 256
    assert decode_split_len(1000, 33, 128, 256) == 256  # 2 tiles of 128
    assert decode_split_len(1000, 33, 64, 1) == 64
    assert decode_split_len(1000, 33, 64, 100) == 128  # whole tiles
    assert decode_split_len(32768, 33, 64, 256) == 1024
    assert decode_split_len(0, 8, 64, 256) == 256  # padding rows: one (empty) active split


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_single_launch_split_ragged(seed, device, make_paged_context, group, head_dim):
    """Ragged contexts over scattered blocks of a strided pool, 7 splits of >= 16 tokens: every
    sequence's last split merges in the same launch; the counters are left at zero."""
    block_size = [8, 16, 32][seed % 3]
    num_kv_heads, splits = 2, 7
    lens = [0, 1, 17, 64, 65, 200, 333]
    pool, tables, seq_lens = make_paged_context(lens, 100, block_size, 2, 1, num_kv_heads,
                                                head_dim, torch.float32, device)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device)
    ws = torch.full((decode_workspace_numel(len(lens), q.shape[1], head_dim, splits),),
                    float("nan"), device=device)
    counters = torch.zeros(len(lens) * num_kv_heads, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens, head_dim ** -0.5,
                           out=out, num_splits=splits, workspace=ws, counters=counters,
                           config=SMALL_TILES, policy=ANY_SPLIT)
    ref = paged_decode_attention_ref(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens,
                                     head_dim ** -0.5)
    msg = f"seed={seed} block_size={block_size}"
    assert -(333 // -decode_split_len(333, splits, 16, 1)) == splits, msg  # all 7 active
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{msg}\n{m}")
    assert torch.all(out[0] == 0), msg
    assert torch.all(counters == 0), f"{msg}: counters not reset: {counters.tolist()}"


def test_repeated_launch_reuses_workspace_and_counters(seed, device, make_paged_context):
    """Three launches sharing one workspace and one counter buffer, as a replayed CUDA graph
    does: the second sees other contexts (the workspace holds the first launch's partials for
    splits it no longer uses); the third repeats the first and matches it bit for bit."""
    lens_a, lens_b = [300, 40, 129], [20, 310, 0]
    pool, tables, _ = make_paged_context([320, 320, 320], 80, 16, 2, 1, 2, 64, torch.float32,
                                         device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    ws = torch.full((decode_workspace_numel(3, 8, 64, 5),), float("nan"), device=device)
    counters = torch.zeros(3 * 2, dtype=torch.int32, device=device)
    outs = []
    for lens in (lens_a, lens_b, lens_a):
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(3, 8, 64, device=device, generator=torch.Generator(device).manual_seed(
            seed + sum(lens)))
        out = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, num_splits=5,
                                     workspace=ws, counters=counters, config=SMALL_TILES,
                                     policy=ANY_SPLIT)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.125)
        msg = f"seed={seed} lens={lens}"
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4,
                                   msg=lambda m, msg=msg: f"{msg}\n{m}")
        assert torch.all(counters == 0), f"{msg}: counters {counters.tolist()}"
        outs.append(out)
    assert torch.equal(outs[0], outs[2]), f"seed={seed}: the merge is not deterministic"


def test_min_split_tokens_caps_the_active_splits(seed, device, make_paged_context):
    """A grid of 33 splits (sized for a long context) over a 1000-token context with the
    default policy: only 4 splits of 256 tokens run and write partials."""
    pool, tables, seq_lens = make_paged_context([1000], 80, 16, 2, 1, 1, 64, torch.float32,
                                                device)
    q = torch.randn(1, 4, 64, device=device)
    ws = torch.full((decode_workspace_numel(1, 4, 64, 33),), float("nan"), device=device)
    out = paged_decode_attention(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens, 0.125,
                                 num_splits=33, workspace=ws)
    ref = paged_decode_attention_ref(q, pool[:, 1, 0], pool[:, 1, 1], tables, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"seed={seed}\n{m}")
    lse = ws[4 * 33 * 64:4 * 33 * 65].view(4, 33)
    written = (~lse.isnan()).any(0).nonzero().flatten().tolist()
    assert written == [0, 1, 2, 3], f"seed={seed}: splits that ran: {written}"


def test_rejects_bad_arguments(device):
    q = torch.randn(2, 4, 64, device=device)
    cache = torch.zeros(4, 16, 2, 64, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, cache, cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), cache, cache,
                               tables, lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(torch.randn(2, 3, 64, device=device), cache, cache, tables,
                               lens, 1.0)


@pytest.mark.skipif(not INTERPRET, reason="a limitation of the Triton interpreter")
def test_interpreter_refuses_bfloat16(device):
    q = torch.randn(1, 4, 64, device=device, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 1, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0)
