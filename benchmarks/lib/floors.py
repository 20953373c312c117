"""What the card allows a run: floors beside a throughput figure, so the figure reads as a share.

    compute floor    the run's FLOPs at the card's measured bf16 matmul rate: the layers'
                     matmuls over every token that goes through the model (the prompt, and
                     every output token but the last, which is sampled and never fed back),
                     the LM head on the rows that sample (a prompt's last token and every
                     output token fed back), attention over each token's context
    bandwidth floor  weight bytes once per step, for the fewest steps the run can take (its
                     longest output), plus the KV bytes every decode token reads, at the card's
                     measured copy bandwidth (a step reads every weight but an embedding table
                     of its own, of which it reads its tokens' rows)
    critical path    per request, in arrival order: the prefill FLOPs of every prompt up to
                     and including its own at the matmul rate (its earliest first token with
                     first-come first-served admission), plus its remaining decode steps at the
                     batch-1 step floor (weights at copy bandwidth); the run cannot end before
                     its slowest request does. The measured first-token time of that request is
                     reported beside it: the difference is time spent waiting for admission.

The run's floor is the largest of the three; `share` is floor / measured duration.

The matmul rate is the best of single products, at the card's full clocks: a floor no run can
beat. Run back to back, the same product holds the card at its power limit and its clocks
fall (an H200: 784 TFLOP/s in single products, ~660 held, its SMs at ~1,455 MHz against
1,980); the run's FLOPs at that held rate (`compute_sustained_s`) are reported beside the
floor, as what a run whose steps are all matmuls would take: where a busy run's time goes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

# Seconds of back-to-back products before the held rate is read (over the last of them).
SUSTAIN_S = 3.0


@dataclass
class Card:
    matmul_tflops: float  # bf16, 8192^3, the best of single products
    # Memory bandwidth from a device-to-device copy: bytes read + written per second / 1e9.
    # A stream that only reads (weights, KV) moves its bytes at this same rate.
    copy_gbps: float
    matmul_sustained_tflops: float | None = None  # the same product back to back, held


def measure_card(device: str) -> Card:
    """The card's rates, measured (before the engine takes its memory: 2.4 GiB here)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def best(fn, reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        return min(times)

    mm = best(lambda: a @ b)
    cp = best(lambda: dst.copy_(src))

    def held() -> float:
        """Products back to back for SUSTAIN_S seconds; the FLOP/s of the last second."""
        def burst() -> None:
            for _ in range(20):
                a @ b
            torch.cuda.synchronize(device)

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < SUSTAIN_S - 1.0:  # the clocks settle
            burst()
        t1, done = time.perf_counter(), 0
        while time.perf_counter() - t1 < 1.0:
            burst()
            done += 20
        return 2 * n**3 * done / (time.perf_counter() - t1)

    return Card(matmul_tflops=2 * n**3 / mm / 1e12, copy_gbps=2 * (1 << 30) / cp / 1e9,
                matmul_sustained_tflops=held() / 1e12)


@dataclass
class Model:
    matmul_params: int  # parameters in matmuls per token (LM head included, embedding not)
    weight_bytes: int  # what a step reads: every parameter as stored, an untied embedding aside
    layers: int
    q_dim: int  # heads x head_dim
    kv_bytes_per_token: int  # all layers, K and V
    lm_head_params: int  # of matmul_params, the LM head's (vocab x hidden): sampled rows only


def describe_model(model, kv_bytes_per_token: int) -> Model:
    cfg = model.config
    table = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:  # a step reads only its tokens' rows of it
        weight_bytes -= table.numel() * table.element_size()
    embed = table.numel()
    total = sum(p.numel() for p in model.parameters())
    matmul = total - embed + (embed if cfg.tie_word_embeddings else 0)
    return Model(matmul, weight_bytes, cfg.num_layers, cfg.num_heads * cfg.head_dim,
                 kv_bytes_per_token, lm_head_params=embed)  # the head has the embedding's shape


def floors(card: Card, model: Model, prompt_lens: list[int], output_lens: list[int],
           ttft_s: list[float], duration_s: float) -> dict:
    """Floors of a run of requests (prompt, output lengths; measured first-token times)."""
    rate = card.matmul_tflops * 1e12
    attn = 4 * model.layers * model.q_dim  # QK^T and PV: 2 FLOPs a multiply-add, per context

    body = model.matmul_params - model.lm_head_params

    def prefill_flops(p: int) -> int:  # the prompt, and the head on its last row
        return 2 * body * p + 2 * model.lm_head_params + attn * (p * (p + 1) // 2)

    # Through the model: the prompt and every output token but the last; each position i
    # attends to i + 1 tokens (the prompt's 1..p, the fed outputs' p + 1 .. p + o - 1).
    fed = sum(prompt_lens) + sum(o - 1 for o in output_lens)
    decode_context = sum((o - 1) * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    context_sum = sum(p * (p + 1) // 2 for p in prompt_lens) + decode_context
    flops = 2 * body * fed + 2 * model.lm_head_params * sum(output_lens) + attn * context_sum
    compute_s = flops / rate
    bw = card.copy_gbps * 1e9  # bytes read per second
    bandwidth_s = (max(output_lens) * model.weight_bytes
                   + decode_context * model.kv_bytes_per_token) / bw
    step_b1 = model.weight_bytes / bw
    critical, prefilled = [], 0
    for p, o in zip(prompt_lens, output_lens):
        prefilled += prefill_flops(p)
        critical.append(prefilled / rate + (o - 1) * step_b1)
    slowest = max(range(len(critical)), key=critical.__getitem__)
    critical_s = critical[slowest]
    floor = max(compute_s, bandwidth_s, critical_s)
    held = card.matmul_sustained_tflops
    return {
        "card": asdict(card), "tflop": flops / 1e12,
        "compute_floor_s": compute_s, "bandwidth_floor_s": bandwidth_s,
        "compute_sustained_s": flops / (held * 1e12) if held else None,
        "critical_path_s": critical_s,
        "critical_request": {"index": slowest, "output_tokens": output_lens[slowest],
                             "earliest_first_token_s": critical_s - (output_lens[slowest] - 1)
                             * step_b1, "measured_first_token_s": ttft_s[slowest]},
        "batch1_step_floor_ms": step_b1 * 1e3,
        "floor_s": floor, "bound_by": ("compute", "bandwidth", "critical path")[
            [compute_s, bandwidth_s, critical_s].index(floor)],
        "share_of_floor": floor / duration_s,
    }
