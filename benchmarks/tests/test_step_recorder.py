"""benchmarks/serving/step_recorder.py: what offline.py records while LLM.generate runs, on the
demo model on the CPU."""

from __future__ import annotations

import pytest


def test_offline_recorder_reads_steps_through_the_engine_observer(monkeypatch):
    """offline.py's StepRecorder sees every step through LLMEngine.on_step (no wrapping): the
    profiler (replaced here, as it needs CUDA) covers exactly every Nth step, from the first,
    and the observer is gone afterwards."""
    from benchmarks.serving import step_recorder as offline
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams

    calls = []
    monkeypatch.setattr(offline, "_start_profiler", lambda rec: calls.append(rec.steps) or "p")
    monkeypatch.setattr(offline, "_stop_profiler", lambda rec, prof: (0.001, 0.002))
    # Pipelined steps, as on a GPU (on the CPU they are off by default).
    llm = LLM("tandem-demo", device="cpu", dtype="float32", progress=False,
              async_scheduling=True)
    finished = []
    rec = offline.StepRecorder(llm.engine, 3, on_finished=finished.append)
    rec.attach()
    outs = llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=8, ignore_eos=True,
                                                           temperature=0))
    rec.detach()
    assert llm.engine.on_step is None
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # 8 steps, and (pipelined) a ninth call that takes the last step's tokens.
    assert rec.steps == 9 and rec.calls_without_batch == 1
    assert sum(finished) == 4 and len(rec.done) == 4
    assert calls == [0, 3, 6, 9]  # started before steps 0, 3, 6 and the call after the last
    kinds = rec.step_account()
    assert sum(kinds[k]["profiled"] for k in offline.STEP_KINDS) == 3
    assert 0 < rec.execute_s < rec.step_s

    # Windows of 4 steps (as for pipelined steps on a GPU): one from step 0, the next armed at
    # the first multiple of 3 after it closed (6), cut short by the run's end; each set against
    # its device span, not its steps' wall time.
    calls.clear()
    rec = offline.StepRecorder(llm.engine, 3, gpu_window=4)
    rec.attach()
    llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=8, ignore_eos=True,
                                                    temperature=0))
    rec.detach()
    assert calls == [0, 6]
    assert [(n, w, b) for n, w, b in rec.windows] == [(4, 0.002, 0.001), (3, 0.002, 0.001)]
    acct = rec.step_account()
    assert acct["all"]["profiled"] == 7 and acct["all"]["host_share"] == pytest.approx(0.5)
    assert acct["all"]["gpu_busy_ms_mean"] == pytest.approx(2 * 0.001 / 7 * 1e3)
