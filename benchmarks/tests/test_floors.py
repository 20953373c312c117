"""The floors beside a throughput figure (benchmarks/lib/floors.py), on numbers worked by hand."""

from __future__ import annotations

import pytest

from benchmarks.lib.floors import Card, Model, floors

MODEL = Model(matmul_params=1_000_000, weight_bytes=10_000_000, layers=2, q_dim=4,
              kv_bytes_per_token=100, lm_head_params=200_000)


def test_floors_worked_by_hand():
    card = Card(matmul_tflops=1.0, copy_gbps=1.0)  # 1e12 FLOP/s; 1e9 bytes read per second
    # Two requests: (prompt 3, output 2) and (prompt 1, output 4).
    f = floors(card, MODEL, [3, 1], [2, 4], ttft_s=[0.5, 0.1], duration_s=1.0)
    # Through the model: 3 + 1 tokens and 1 + 3 (an output's last token is never fed back), at
    # positions 0-3 each, attending to 1 + 2 + 3 + 4 = 10 tokens; the head on the 2 + 4 rows
    # sampled. 32 attention FLOPs per context token (4 x 2 layers x q_dim 4).
    flops = 2 * 800_000 * (4 + 4) + 2 * 200_000 * (2 + 4) + 32 * (10 + 10)
    assert f["tflop"] == pytest.approx(flops / 1e12)
    assert f["compute_floor_s"] == pytest.approx(flops / 1e12)
    # Four steps at least (the longest output), weights once per step, plus the KV the decode
    # steps read: request 0's one step at position 3 reads 4 tokens, request 1's three at 1-3
    # read 2 + 3 + 4 (100 bytes each).
    assert f["bandwidth_floor_s"] == pytest.approx((4 * 10_000_000 + 13 * 100) / 1e9)
    # Batch-1 step: 10 ms. Request 0: its prefill (the head on its last row) + 1 step; request
    # 1: both prefills + 3 steps: the slowest.
    p0 = 2 * 800_000 * 3 + 2 * 200_000 + 32 * 6
    p1 = 2 * 800_000 * 1 + 2 * 200_000 + 32 * 1
    assert f["batch1_step_floor_ms"] == pytest.approx(10.0)
    assert f["critical_path_s"] == pytest.approx((p0 + p1) / 1e12 + 0.03)
    assert f["critical_request"]["index"] == 1
    assert f["critical_request"]["measured_first_token_s"] == 0.1
    assert f["bound_by"] == "bandwidth"  # 40 ms of weights beats 30 ms of steps
    assert f["share_of_floor"] == pytest.approx(f["bandwidth_floor_s"] / 1.0)
    assert f["compute_sustained_s"] is None  # no held rate measured


def test_the_held_matmul_rate_times_the_same_flops_and_leaves_the_floor():
    burst = floors(Card(matmul_tflops=1.0, copy_gbps=1.0), MODEL, [3, 1], [2, 4],
                   ttft_s=[0.5, 0.1], duration_s=1.0)
    held = floors(Card(matmul_tflops=1.0, copy_gbps=1.0, matmul_sustained_tflops=0.8), MODEL,
                  [3, 1], [2, 4], ttft_s=[0.5, 0.1], duration_s=1.0)
    assert held["compute_sustained_s"] == pytest.approx(burst["compute_floor_s"] / 0.8)
    for key in ("compute_floor_s", "bandwidth_floor_s", "critical_path_s", "floor_s"):
        assert held[key] == burst[key]  # the floor stays what no run can beat


@pytest.mark.parametrize("tied", [True, False])
def test_a_step_reads_the_head_but_not_an_untied_embedding_table(tied):
    import torch

    from benchmarks.lib.floors import describe_model
    from tandem.engine.config import ModelConfig
    from tandem.engine.models import model_class

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "tie_word_embeddings": tied})
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg).to(torch.bfloat16)
    m = describe_model(model, kv_bytes_per_token=0)
    layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 8 * 32 + 16 * 8 + 2 * 8  # q, k + v, o, gate + up, down, norms
    assert m.lm_head_params == 100 * 8
    assert m.matmul_params == 2 * layer + 8 + 100 * 8  # the final norm, the head
    assert m.weight_bytes == 2 * m.matmul_params  # bf16; the head read, the table's rows not
