"""What benchmarks/serving/offline.py records while LLM.generate runs: the engine's step observer
(`LLMEngine.on_step`), called after every step, notes token times per request, the sequences
running, KV slots allocated vs filled, and each step's kind and wall time; every Nth step runs
under torch.profiler (CUDA activity only) to split its wall time into GPU busy time and the
rest. With pipelined steps one step's wall time holds another step's device work, so there the
profiler covers a window of consecutive steps instead, and the GPU's idle share is taken over
the window's device timeline (first kernel to last)."""

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
    allocated vs filled, and the step's wall time by kind. Every `gpu_every`-th step starts a
    window of `gpu_window` steps under torch.profiler (CUDA activity only): the profiler starts
    at the end of the step before (for the first step, in `attach`) and stops in the window's
    last step's callback. The GPU's busy time (union of kernel and copy intervals) is set
    against the step's wall time for a one-step window (synchronous steps: the step's host work
    is the gap), and against the span from the window's first kernel to its last for a longer
    one (pipelined steps: the gaps inside the device timeline, the start's drained pipeline
    excluded). The callbacks' own time (`profiler_s`, `record_s`) falls outside the steps'
    timing; the caller takes the bookkeeping (`record_s`) off the run's duration. The profiler's
    waits for the device are not counted in `profiler_s` (the device work is the run's)."""

    def __init__(self, engine, gpu_every: int, on_finished=None, gpu_window: int = 1) -> None:
        self.engine = engine
        self.block_size = engine.block_pool.block_size
        self.gpu_every = gpu_every
        self.gpu_window = max(1, gpu_window)
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
        # windows made of that kind's steps alone: (steps, wall or device span s, GPU busy s).
        self.kinds: dict[str, list] = {k: [0, 0, 0.0, []] for k in STEP_KINDS}
        self.windows: list[tuple[int, float, float]] = []  # every profiled window, any kinds
        self.saturated = [0, 0.0]  # tokens sampled and seconds in steps with >= 200 running
        self.gpu_error: str | None = None
        self._prof = None
        self._win: list = []  # the open window: kinds of its steps (None: no batch), wall s

    def attach(self) -> None:
        self.engine.on_step = self._on_step
        self._arm()

    def detach(self) -> None:
        self.engine.on_step = None
        if self._prof is not None:  # a window the run's end cut short, or never begun
            t = time.perf_counter()
            if self._win[0]:
                self._close_window()
            else:
                _stop_profiler(self, self._prof)
                self._prof = None
            self.profiler_s += time.perf_counter() - t

    def _arm(self) -> None:
        """Start the profiler when the next step is one to sample."""
        if self.gpu_every and self.gpu_error is None and self.steps % self.gpu_every == 0:
            t = time.perf_counter()
            self._prof = _start_profiler(self)
            self._win = [[], 0.0]
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
            self._win[0].append(step_kind(last) if last.num_seqs else None)
            self._win[1] += last.seconds
            if len(self._win[0]) >= self.gpu_window:
                self._close_window()
            self.profiler_s += time.perf_counter() - now
        t = time.perf_counter()
        self._record(outs, now)
        self.record_s += time.perf_counter() - t
        if self._prof is None:
            self._arm()

    def _close_window(self) -> None:
        got = _stop_profiler(self, self._prof)
        self._prof = None
        kinds, wall = self._win
        if got is None:
            return
        busy, span = got
        steps = len(kinds)
        if steps > 1:
            wall = span  # pipelined: the device timeline's own gaps
        self.windows.append((steps, wall, busy))
        if len(set(kinds)) == 1 and kinds[0] is not None:
            self.kinds[kinds[0]][3].append((steps, wall, busy))

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
        mean GPU-busy time and host time (wall minus busy: no kernel or copy running); `all`:
        the same over every profiled window, whatever its steps' kinds."""
        out: dict = {"gpu_sampled_every": self.gpu_every, "gpu_window": self.gpu_window,
                     "gpu_error": self.gpu_error}
        for name, (steps, tokens, wall, prof) in self.kinds.items():
            out[name] = {"steps": steps, "tokens": tokens,
                         "wall_ms_mean": wall / steps * 1e3 if steps else None, **_busy(prof)}
        out["all"] = {"steps": self.steps, "tokens": sum(k[1] for k in self.kinds.values()),
                      "wall_ms_mean": self.step_s / self.steps * 1e3 if self.steps else None,
                      **_busy(self.windows)}
        return out


def _busy(prof: list[tuple[int, float, float]]) -> dict:
    """Profiled windows' (steps, wall s, busy s) as means a step and the host's share."""
    row = {"profiled": sum(n for n, _, _ in prof), "gpu_busy_ms_mean": None,
           "host_ms_mean": None, "host_share": None}
    n = sum(n for n, _, _ in prof)
    if n:
        p_wall = sum(w for _, w, _ in prof)
        p_busy = sum(b for _, _, b in prof)
        row.update(gpu_busy_ms_mean=p_busy / n * 1e3, host_ms_mean=(p_wall - p_busy) / n * 1e3,
                   host_share=1 - p_busy / p_wall if p_wall > 0 else None)
    return row


def _start_profiler(rec: StepRecorder):
    try:
        from torch.profiler import ProfilerActivity, profile

        _sync(rec)
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
        return prof
    except Exception as e:  # noqa: BLE001 - measuring must not break the run
        rec.gpu_error = f"{type(e).__name__}: {e}"
        return None


def _sync(rec: StepRecorder) -> None:
    """Wait for the device; the wait is the run's device work, not the profiler's cost."""
    import torch

    t = time.perf_counter()
    torch.cuda.synchronize()
    rec.profiler_s -= time.perf_counter() - t


def _stop_profiler(rec: StepRecorder, prof) -> tuple[float, float] | None:
    """Seconds the GPU was busy (union of device-side intervals) during the profiled window,
    and the span from its first kernel's start to its last one's end."""
    try:
        from torch.autograd import DeviceType

        _sync(rec)
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
    span = max(hi for _, hi in spans) - spans[0][0]
    return busy / 1e6, span / 1e6  # microseconds -> seconds
