"""One colocated worker driven straight through its Stream call, no router: every request of
the workload sent at once on one call, tokens read until all finish. The middle row of
token_path.sh: what the worker's process costs against the offline engine, before the router's
and the client's share.

    python benchmarks/serving/worker_stream.py --model tandem-demo --devices cpu --workload fixed \\
        --prompt-len 32 --output-len 64 --num-requests 64 --out worker.json

Takes serve.py's stack and workload flags; writes output tokens/s, tokens and the CPU seconds of
the worker process and of this client during the run (after a warm-up on the same call), and the
engine steps the worker ran.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc

from benchmarks.lib import common, procstat
from benchmarks.lib.workloads import build_workload
from benchmarks.serving import serve
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import worker_pb2, worker_pb2_grpc


async def drive(address: str, requests: list, tag: str) -> int:
    """Send every request on one Stream call; the output tokens that came back."""
    msgs = [worker_pb2.StreamRequest(generate=worker_pb2.GenerateOnWorkerRequest(
        request_id=f"{tag}-{i}", prompt_token_ids=r.prompt, params=params_to_proto(
            SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0))))
        for i, r in enumerate(requests)]
    tokens = 0
    async with grpc.aio.insecure_channel(address) as ch:
        async for resp in worker_pb2_grpc.WorkerStub(ch).Stream(iter(msgs)):
            tokens += len(resp.tokens.token_ids)
            for u in resp.updates:
                if u.error_code:
                    raise RuntimeError(f"{u.request_id}: {u.error_message}")
    return tokens


def main(argv: list[str] | None = None) -> int:
    a = serve.build_parser().parse_args(argv)
    vocab, _ = common.model_vocab(a.model)
    requests = build_workload(a, vocab)
    stack = serve.launch_stack(a.model, ["both"], common.resolve_devices(a.devices, 1),
                               serve.common_worker_args(a, []), ["--http-port", "-1"], a.log_dir)
    try:
        stack.start()
        worker = stack.workers()[0]
        pinned = procstat.pin_stack(stack) if a.pin else None
        asyncio.run(drive(worker.address, common.warmup_requests(a, vocab), "warmup"))
        cpu0, c0, t0 = procstat.process_cpu_s(worker.popen.pid), time.process_time(), \
            time.perf_counter()
        steps0 = procstat.engine_steps(worker.metrics_url)
        threads0 = procstat.thread_stats(worker.popen.pid)
        tokens = asyncio.run(drive(worker.address, requests, "run"))
        seconds = time.perf_counter() - t0
        cpu = {"both0": procstat.process_cpu_s(worker.popen.pid) - cpu0,
               "client": time.process_time() - c0}
        steps = {"both0": procstat.engine_steps(worker.metrics_url) - steps0}
        threads = {"both0": procstat.thread_deltas(threads0, procstat.thread_stats(worker.popen.pid))}
    finally:
        stack.stop()
    expected = sum(r.max_tokens for r in requests)
    report = {"benchmark": "worker_stream", "model": a.model, "workload": a.workload,
              "num_requests": len(requests), "duration_s": seconds, "output_tokens": tokens,
              "expected_output_tokens": expected, "output_throughput": tokens / seconds,
              "cpu_s": cpu, "threads": threads, "engine_steps": steps,
              "pinned": pinned}
    print(f"{len(requests)} requests on one Stream call: {tokens} tokens in {seconds:.2f} s, "
          f"{tokens / seconds:.0f} output tok/s")
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0 if tokens == expected else 1


if __name__ == "__main__":
    sys.exit(main())
