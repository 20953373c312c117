"""What benchmarks/offline.py records while LLM.generate runs: the engine's step observer
(`LLMEngine.on_step`), called after every step, notes token times per request, the sequences
running, KV slots allocated vs filled, and each step's kind and wall time; every Nth step runs
under torch.profiler (CUDA activity only) to split its wall time into GPU busy time and the
rest."""

from __future__ import annotations

import time

STEP_KINDS = ("decode", "mixed", "prefill")
SATURATED_SEQS = 200  # the saturated phase: steps running at least this many sequences


def step_kind(step) -> str:
    """decode: every sequence advanced one token; prefill: none did; mixed: both kinds."""
    if step.num_decodes == step.num_seqs:
        return "decode"
    return "prefill" if step.num_decodes == 0 else "mixed"


class StepRecorder:
    """Set as one LLMEngine's step observer (`engine.on_step`) while LLM.generate drives it;
    after every step records token arrival times per request, the sequences running, KV slots
    allocated vs filled, and the step's wall time by kind. Every `gpu_every`-th step runs under
    torch.profiler (CUDA activity only): the profiler starts at the end of the step before (for
    the first step, in `attach`) and stops in the step's own callback, and the GPU's busy time
    (union of kernel and copy intervals) is set against the step's wall time. The callbacks'
    own time (`profiler_s`, `record_s`) falls outside the steps' timing; the caller takes it off
    the run's duration."""

    def __init__(self, engine, gpu_every: int, on_finished=None) -> None:
        self.engine = engine
        self.block_size = engine.block_pool.block_size
        self.gpu_every = gpu_every
        self.on_finished = on_finished  # called with the number of requests a step finished
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.itls: list[float] = []
        self.steps = 0  # engine step() calls
        self.calls_without_batch = 0  # of them: no batch scheduled (see _on_step)
        self.step_s = 0.0
        self.execute_s = 0.0
        self.profiler_s = 0.0  # profiler set-up and parsing
        self.record_s = 0.0  # this recorder's bookkeeping after each step
        self.peak_running = 0
        self.peak_used_blocks = 0
        self.alloc_slot_steps = 0
        self.filled_slot_steps = 0
        self.step_waste: list[float] = []
        # Per step kind (decode, mixed, prefill): steps, tokens, wall s; and the profiled
        # steps' (wall s, GPU busy s).
        self.kinds: dict[str, list] = {k: [0, 0, 0.0, []] for k in STEP_KINDS}
        self.saturated = [0, 0.0]  # tokens sampled and seconds in steps with >= 200 running
        self.gpu_error: str | None = None
        self._prof = None

    def attach(self) -> None:
        self.engine.on_step = self._on_step
        self._arm()

    def detach(self) -> None:
        self.engine.on_step = None
        if self._prof is not None:  # armed for a step that never came
            t = time.perf_counter()
            _stop_profiler(self, self._prof)
            self._prof = None
            self.profiler_s += time.perf_counter() - t

    def _arm(self) -> None:
        """Start the profiler when the next step is one to sample."""
        if self.gpu_every and self.gpu_error is None and self.steps % self.gpu_every == 0:
            t = time.perf_counter()
            self._prof = _start_profiler(self)
            self.profiler_s += time.perf_counter() - t

    def _on_step(self, outs) -> None:
        now = time.perf_counter()
        last = self.engine.last_step
        self.steps += 1
        self.step_s += last.seconds
        self.execute_s += self.engine.last_execute_s
        kind = self.kinds[step_kind(last)] if last.num_seqs else None
        if kind is None:  # pipelined: a call that only took the previous step's tokens
            self.calls_without_batch += 1
        else:
            kind[0] += 1
            kind[1] += last.num_tokens
            kind[2] += last.seconds
            if last.num_seqs >= SATURATED_SEQS:
                self.saturated[0] += last.num_sampled
                self.saturated[1] += last.seconds
        if self._prof is not None:
            busy = _stop_profiler(self, self._prof)
            self._prof = None
            if busy is not None and kind is not None:
                kind[3].append((last.seconds, busy))
            self.profiler_s += time.perf_counter() - now
        t = time.perf_counter()
        self._record(outs, now)
        self.record_s += time.perf_counter() - t
        self._arm()

    def _record(self, outs, now: float) -> None:
        finished = 0
        for o in outs:
            rid = o.request_id
            if o.new_token_ids:
                last = self.last.get(rid)
                if last is None:
                    self.first[rid] = now
                else:
                    self.itls.append(now - last)
                self.last[rid] = now
            if o.finish_reason is not None:
                self.done[rid] = now
                finished += 1
        running = self.engine.scheduler.running
        blocks = filled = 0
        for s in running:
            blocks += len(s.block_ids)
            filled += s.num_computed_tokens
        self.peak_running = max(self.peak_running, len(running))
        self.peak_used_blocks = max(self.peak_used_blocks, self.engine.block_pool.num_used)
        if blocks:
            alloc = blocks * self.block_size
            self.alloc_slot_steps += alloc
            self.filled_slot_steps += filled
            self.step_waste.append(1 - filled / alloc)
        if finished and self.on_finished is not None:
            self.on_finished(finished)

    def step_account(self) -> dict:
        """Per step kind: steps, tokens, mean wall time; over the profiled steps of that kind,
        mean GPU-busy time and host time (wall minus busy: no kernel or copy running)."""
        out: dict = {"gpu_sampled_every": self.gpu_every, "gpu_error": self.gpu_error}
        for name, (steps, tokens, wall, prof) in self.kinds.items():
            row = {"steps": steps, "tokens": tokens,
                   "wall_ms_mean": wall / steps * 1e3 if steps else None,
                   "profiled": len(prof), "gpu_busy_ms_mean": None, "host_ms_mean": None,
                   "host_share": None}
            if prof:
                p_wall = sum(w for w, _ in prof)
                p_busy = sum(b for _, b in prof)
                row.update(gpu_busy_ms_mean=p_busy / len(prof) * 1e3,
                           host_ms_mean=(p_wall - p_busy) / len(prof) * 1e3,
                           host_share=1 - p_busy / p_wall)
            out[name] = row
        return out


def _start_profiler(rec: StepRecorder):
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
        return prof
    except Exception as e:  # noqa: BLE001 - measuring must not break the run
        rec.gpu_error = f"{type(e).__name__}: {e}"
        return None


def _stop_profiler(rec: StepRecorder, prof) -> float | None:
    """Seconds the GPU was busy (union of device-side intervals) during the profiled step."""
    try:
        import torch
        from torch.autograd import DeviceType

        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA)
    except Exception as e:  # noqa: BLE001
        rec.gpu_error = f"{type(e).__name__}: {e}"
        return None
    if not spans:
        rec.gpu_error = "the profiler recorded no GPU activity"
        return None
    busy, (cur_lo, cur_hi) = 0.0, spans[0]
    for lo, hi in spans[1:]:
        if lo > cur_hi:
            busy += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    busy += cur_hi - cur_lo
    return busy / 1e6  # microseconds -> seconds
