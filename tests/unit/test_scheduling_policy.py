"""Admission order and pacing (engine/wait_queue.py, engine/scheduler.py): priorities under
both policies; under critical-path, the request whose outputs set the run's length first, the
rest shortest prompt first, prompts off that path paced, a starved request first, a preempted
one before everything. Plain Python on exact token counts, the model replaced by run_step."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import RemoteKV, Sequence, Status
from tandem.errors import InvalidArgument

BS = 4


@pytest.fixture
def pool():
    p = BlockPool(num_blocks=256, block_size=BS)
    yield p
    assert p.is_idle(), f"pool not idle after test: refs {p.ref_counts}"


def seq(rid, prompt_len, max_tokens=4, priority=0):
    return Sequence(rid, [1 + (i % 50) for i in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, temperature=0, priority=priority))


def scheduler(pool, policy, budget=64, max_seqs=64, min_step=8):
    """Role both or decode (paced under critical-path)."""
    return Scheduler(SchedulerConfig(budget, max_seqs, 4096, policy, min_step),
                     KVCacheManager(pool))


def run_step(sched, batch):
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def finish_all(sched):
    for s in list(sched.running) + list(sched.waiting):
        sched.kv.free(s)
        s.status = Status.FINISHED
    sched.remove_finished()


def admitted(batch):
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


@pytest.mark.parametrize("policy", ["fcfs", "critical-path"])
def test_lower_priority_value_is_admitted_first(pool, policy):
    sched = scheduler(pool, policy, max_seqs=1)
    for rid, prio in (("a", 1), ("b", 0), ("c", 0)):
        sched.add(seq(rid, 8, priority=prio))
    order = []
    while sched.has_work():
        batch = sched.schedule()
        order += [s.request_id for s in batch.seqs if s.request_id not in order]
        run_step(sched, batch)
        for s in list(sched.running):
            if s.num_output_tokens >= s.params.max_tokens:
                sched.kv.free(s)
                s.status = Status.FINISHED
        sched.remove_finished()
    assert order == ["b", "c", "a"]


def test_fcfs_keeps_arrival_order(pool):
    sched = scheduler(pool, "fcfs", budget=20)
    for rid, n, out in (("a", 12, 2), ("b", 4, 2), ("c", 4, 50)):
        sched.add(seq(rid, n, out))
    assert admitted(sched.schedule()) == [("a", 12), ("b", 4), ("c", 4)]
    finish_all(sched)


def test_critical_path_admits_the_longest_output_first_then_shortest_prompts(pool):
    sched = scheduler(pool, "critical-path", budget=64, min_step=8)
    sched.add(seq("long-prompt", 30, 3))
    sched.add(seq("short-prompt", 6, 3))
    sched.add(seq("long-output", 10, 100))
    batch = sched.schedule()
    # The long output is the critical path: the whole budget if it needs it. Work left is
    # 30+2 + 6+2 + 10+99 = 149 tokens over 100 steps: 2 a step, floored at 8, which its 10
    # prompt tokens spent this step.
    assert admitted(batch) == [("long-output", 10)]
    run_step(sched, batch)
    # Then the shorter prompt first, within the paced 8: the decode takes 1, the short prompt
    # 6, the long one the token left (a one-token chunk runs with the decodes).
    assert admitted(sched.schedule()) == [("long-output", 1), ("long-prompt", 1),
                                          ("short-prompt", 6)]
    finish_all(sched)


def test_critical_path_paces_prompts_off_the_path_but_not_decodes(pool):
    sched = scheduler(pool, "critical-path", budget=64, min_step=8)
    sched.add(seq("long-output", 4, 200))
    run_step(sched, sched.schedule())  # its prompt; it decodes from now on
    for i in range(6):
        sched.add(seq(f"p{i}", 20, 3))
    batch = sched.schedule()
    # Horizon 199 steps; work left 199 + 6 x 22 = 331 tokens: 2 a step, floored at 8: the
    # decode takes 1, a prompt the other 7.
    assert admitted(batch) == [("long-output", 1), ("p0", 7)]
    run_step(sched, batch)
    batch = sched.schedule()
    assert admitted(batch) == [("long-output", 1), ("p0", 7)]
    finish_all(sched)


def test_critical_path_gives_a_request_alone_the_whole_budget(pool):
    sched = scheduler(pool, "critical-path", budget=64, min_step=8)
    sched.add(seq("alone", 100, 5))
    assert admitted(sched.schedule()) == [("alone", 64)]
    finish_all(sched)


def test_a_request_waiting_too_long_goes_before_shorter_prompts(pool):
    now = [0.0]
    sched = scheduler(pool, "critical-path", budget=64, min_step=8)
    sched.waiting.clock = lambda: now[0]
    sched.add(seq("long-output", 4, 200))
    run_step(sched, sched.schedule())
    old = seq("old", 30, 3)
    old.arrival_time = -100.0
    sched.add(old)
    sched.add(seq("short", 5, 3))
    assert admitted(sched.schedule())[1][0] == "old"  # waited past max_wait_s
    finish_all(sched)


def test_a_preempted_sequence_goes_back_first(pool):
    sched = scheduler(pool, "critical-path")
    a, b = seq("a", 8, 50), seq("b", 3, 3)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)
    sched.running.remove(a)
    sched._preempt(a)
    assert sched.waiting.head() is a
    finish_all(sched)


def test_the_prefill_role_orders_by_the_policy_but_paces_nothing(tmp_path):
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})
    args = dict(model="m", scheduling_policy="critical-path")
    prefill = EngineConfig(role="prefill", **args).scheduler_config(cfg)
    decode = EngineConfig(role="decode", **args).scheduler_config(cfg)
    assert (prefill.policy, prefill.pace) == ("critical-path", False)
    assert (decode.policy, decode.pace) == ("critical-path", True)
    with pytest.raises(InvalidArgument, match="scheduling_policy"):
        EngineConfig(model="m", scheduling_policy="lifo").scheduler_config(cfg)


def test_without_pacing_the_longest_output_goes_first_and_prompts_take_the_budget(pool):
    # Role prefill: the same request mix as the paced test above, one step.
    sched = Scheduler(SchedulerConfig(64, 64, 4096, "critical-path", 8, pace=False),
                      KVCacheManager(pool))
    sched.add(seq("long-prompt", 30, 3))
    sched.add(seq("short-prompt", 6, 3))
    sched.add(seq("long-output", 10, 100))
    assert admitted(sched.schedule()) == [("long-output", 10), ("short-prompt", 6),
                                          ("long-prompt", 30)]
    finish_all(sched)


def pulled(rid, prompt_len, max_tokens):
    """A decode role's request: its prompt KV on a prefill worker (blocks 0.. there)."""
    s = seq(rid, prompt_len, max_tokens)
    s.remote = RemoteKV("p", f"L-{rid}", float("inf"), tuple(range(-(-prompt_len // BS))),
                        (7,), (None,))
    return s


def pull_done(batch):
    """What the engine does once a pull is in (LLMEngine._start_decoding): the prompt counts
    as computed and the first token, from the prefill worker, is appended."""
    for s in batch.pulls:
        s.num_computed_tokens = s.num_prompt_tokens
        s.token_ids.append(7)


def test_the_decode_role_paces_pulled_prompts_into_the_batch(pool):
    sched = scheduler(pool, "critical-path", min_step=1)
    sched.waiting.max_wait_s = float("inf")  # nothing overdue however slow the machine
    sched.add(pulled("long", 8, 200))
    for i in range(20):
        sched.add(pulled(f"s{i}", 8, 10))
    # Horizon 200 steps; the work is the outputs alone (a pulled prompt is not computed
    # here): 200 + 20 x 10 = 400 tokens, 2 a step. The longest output is on the path.
    batch = sched.schedule()
    assert [s.request_id for s in batch.pulls] == ["long", "s0"] and not batch.seqs
    pull_done(batch)
    # 199 + 9 decodes left for the two running, 19 x 10 waiting, over 199 steps: 2 a step,
    # which the two decodes take.
    batch = sched.schedule()
    assert admitted(batch) == [("long", 1), ("s0", 1)] and not batch.pulls
    finish_all(sched)


def test_a_pulled_prompt_waiting_past_max_wait_s_is_admitted_beyond_the_pace(pool):
    now = [0.0]
    sched = scheduler(pool, "critical-path", min_step=1)
    sched.waiting.clock = lambda: now[0]
    for s in [pulled("long", 8, 200)] + [pulled(f"s{i}", 8, 10) for i in range(4)]:
        s.arrival_time = 0.0
        sched.add(s)
    batch = sched.schedule()
    assert len(batch.pulls) == 2
    pull_done(batch)
    assert not sched.schedule().pulls  # the two decodes take the step's paced share
    now[0] = sched.waiting.max_wait_s + 1
    assert [s.request_id for s in sched.schedule().pulls] == ["s1", "s2", "s3"]
    finish_all(sched)


def test_a_request_moved_mid_stream_is_admitted_beyond_the_pace(pool):
    sched = scheduler(pool, "critical-path", min_step=1)
    sched.waiting.max_wait_s = float("inf")
    sched.add(pulled("long", 8, 200))
    for i in range(4):
        sched.add(pulled(f"s{i}", 8, 10))
    moved = pulled("moved", 8, 10)
    moved.remote = dataclasses.replace(moved.remote, handover=True, num_tokens=8)
    sched.add(moved)
    # The moved request, decoding elsewhere until now, first and beside the pace; then long
    # and s0 take the paced 2 (the moved one decodes in the steps after, counted then).
    assert [s.request_id for s in sched.schedule().pulls] == ["moved", "long", "s0"]
    finish_all(sched)


def test_fcfs_admits_every_pulled_prompt_at_once(pool):
    sched = scheduler(pool, "fcfs", min_step=1)
    for s in [pulled("long", 8, 200)] + [pulled(f"s{i}", 8, 10) for i in range(20)]:
        sched.add(s)
    assert len(sched.schedule().pulls) == 21
    finish_all(sched)


@pytest.mark.parametrize("bad", [True, 1.5, "1", 2**31])
def test_priority_is_a_bounded_integer(bad):
    with pytest.raises(InvalidArgument, match="priority"):
        SamplingParams(priority=bad)
