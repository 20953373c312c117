"""Prefill:decode ratio study: on N GPUs, every split pP:(N-p)D and N colocated workers behind one
router, under a prompt-heavy and a decode-heavy workload at several rates (benchmarks/serving/serve.py's
launch and load); a table of throughput, TTFT, ITL and goodput per layout, workload and rate
with the card named, the best layout per workload, and goodput against rate per workload.

    # everything (4 GPUs: 1P3D 2P2D 3P1D 4C; 2 GPUs: 1P1D 2C)
    python benchmarks/serving/ratio.py --model benchmarks/configs/llama-3.1-8b --gpus 4 \\
        --rates 2 4 8 16 --num-requests 200 --out-dir ratio-8b
    # or one layout per command (a GPU command has a time limit), then the report alone
    python benchmarks/serving/ratio.py ... --layouts 1P3D --out-dir ratio-8b
    python benchmarks/serving/ratio.py --report-only --out-dir ratio-8b

Layout names: <p>P<d>D (p prefill + d decode workers) or <n>C (n colocated); worker k runs on
GPU k (prefill workers first). Each layout's results go to OUT_DIR/layout-<name>.json as soon as
a workload finishes; the report reads every such file there. Engine flags after `--` go to
every worker. The best layout for a workload is the one with the highest goodput at any finite
rate (the load it carries within the SLOs); ties go to the higher mean goodput over the rates.
Goodput and the latency definitions are serve.py's (see `serve.py --help`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[2]
# The repository first, even when PYTHONPATH already lists it: the script's own directory
# (a benchmarks/ folder) must not shadow a package of the same name.
sys.path.insert(0, str(ROOT))

from benchmarks.lib import common  # noqa: E402
from benchmarks.lib.workloads import add_workload_args, build_workload  # noqa: E402
from benchmarks.serving import serve, serve_client, serve_runs  # noqa: E402

if TYPE_CHECKING:
    from tandem.cli.launcher import LocalStack

LAYOUT = re.compile(r"^(?:(\d+)P(?:tp(\d+)_)?(\d+)D(?:tp(\d+))?|(\d+)C(?:tp(\d+))?)$",
                    re.IGNORECASE)


@dataclass
class Layout:
    """Workers by role in the order prefill, decode, colocated; each role's tensor-parallel
    size. Worker k takes the next tp[role] GPUs, named by the first."""

    name: str
    roles: list[str]
    tp: dict[str, int]

    @property
    def gpus(self) -> int:
        return sum(self.tp[r] for r in self.roles)

    def devices(self, device_type: str) -> list[str]:
        if device_type != "cuda":
            return ["cpu"] * len(self.roles)
        out, at = [], 0
        for r in self.roles:
            out.append(f"cuda:{at}")
            at += self.tp[r]
        return out

    def role_args(self) -> dict[str, list[str]]:
        return {r: ["--tensor-parallel-size", str(k)] for r, k in self.tp.items() if k > 1}

    def label(self) -> str:
        """1P(TP2):2D, 4C, ..."""
        def part(n: int, tag: str, role: str) -> str:
            return f"{n}{tag}" + (f"(TP{self.tp[role]})" if self.tp[role] > 1 else "")
        if self.roles[0] == "both":
            return part(len(self.roles), "C", "both")
        return (f"{part(self.roles.count('prefill'), 'P', 'prefill')}:"
                f"{part(self.roles.count('decode'), 'D', 'decode')}")


def derived_layouts(gpus: int) -> list[str]:
    """Every prefill:decode split of the GPUs, then all of them colocated."""
    return [f"{p}P{gpus - p}D" for p in range(1, gpus)] + [f"{gpus}C"]


def parse_layout(name: str) -> Layout:
    """<p>P<d>D or <n>C, each role optionally at a tensor-parallel size: 1Ptp2_2D (one prefill
    worker at TP 2, two decode at TP 1), 2P1Dtp2, 2Ctp2."""
    m = LAYOUT.match(name)
    if not m:
        raise SystemExit(f"ratio.py: bad layout {name!r}: use <p>P<d>D or <n>C, a role at "
                         "tensor-parallel size k as <p>Ptp<k>_<d>D, <p>P<d>Dtp<k>, <n>Ctp<k>")
    p, p_tp, d, d_tp, c, c_tp = m.groups()
    if c:
        return Layout(name, ["both"] * int(c), {"both": int(c_tp or 1)})
    return Layout(name, ["prefill"] * int(p) + ["decode"] * int(d),
                  {"prefill": int(p_tp or 1), "decode": int(d_tp or 1)})


def rates_for(a: argparse.Namespace, workload: str) -> list[float]:
    for item in a.rates_for or []:
        name, _, values = item.partition("=")
        if name == workload:
            return [common.parse_rate(v) for v in values.split(",") if v]
    return a.rates


def start_layout(a: argparse.Namespace, name: str, passthrough: list[str]
                 ) -> tuple[Layout, LocalStack]:
    """The layout's workers and router, started."""
    lay = parse_layout(name)
    if a.device_type == "cuda" and lay.gpus > a.gpus:
        raise SystemExit(f"ratio.py: layout {name} needs {lay.gpus} GPUs, --gpus is {a.gpus}")
    devices = lay.devices(a.device_type)
    stack = serve.launch_stack(a.model, lay.roles, devices, serve.common_worker_args(a, passthrough),
                               serve.router_args(a, passthrough, a.num_requests),
                               a.log_dir / name if a.log_dir else None, role_args=lay.role_args())
    print(f"== {lay.label()}: starting {', '.join(f'{r}@{d}' for r, d in zip(lay.roles, devices))}"
          f" (logs in {stack.log_dir})", flush=True)
    return lay, stack


def run_layout(a: argparse.Namespace, name: str, passthrough: list[str]) -> dict:
    vocab, model_max = common.model_vocab(a.model)
    lay, stack = start_layout(a, name, passthrough)
    result = {"layout": name, "label": lay.label(), "roles": lay.roles, "tp": lay.tp,
              "model": a.model, "dtype": a.dtype, "engine_args": passthrough,
              "environment": common.environment(), "workloads": {}}
    path = a.out_dir / f"layout-{name}.json"
    t = time.perf_counter()
    try:
        stack.start()
        result["startup_s"] = time.perf_counter() - t
        result["workers"] = serve.describe_workers(stack)
        result["card"] = ", ".join(sorted({w["card"] for w in result["workers"]}))
        opts = serve_client.LoadOptions(
            api="grpc", target=stack.router.address, channels=a.channels,
            request_timeout=a.request_timeout, slo_ttft_ms=a.slo_ttft_ms,
            slo_itl_ms=a.slo_itl_ms, goodput_itl=a.goodput_itl,
            client_procs=a.client_procs or serve.default_client_procs(), progress=a.progress)
        for w in a.workloads:
            a.workload = w
            requests = build_workload(a, vocab)
            common.check_lengths(requests, min(a.max_model_len, model_max))
            runs = serve_runs.run_rates(opts, requests, rates_for(a, w), a.seed,
                                        label=f"{name} {w} ",
                                        warmup=common.warmup_requests(a, vocab),
                                        cooldown_s=a.cooldown, stack=stack)
            result["workloads"][w] = [r["summary"] for r in runs]
            result.setdefault("requests", {})[w] = [r["requests"] for r in runs]
            serve_runs.print_online(runs, f"-- {lay.label()} {w} on {result['card']}")
            path.write_text(json.dumps(common.strip_private(result), indent=1))
    finally:
        result["exit_codes"] = stack.stop()
        a.out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(common.strip_private(result), indent=1))
    return result


def greedy_tokens(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation through the router's gRPC API, all sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from tandem.engine.sampling_params import SamplingParams
    from tandem.runtime.convert import params_to_proto
    from tandem.v1 import api_pb2, api_pb2_grpc

    params = params_to_proto(SamplingParams(temperature=0, max_tokens=max_tokens,
                                            ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        stub = api_pb2_grpc.TandemStub(ch)

        def one(prompt: list[int]) -> list[int]:
            req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt), params=params)
            return [t for chunk in stub.Generate(req, timeout=600) for t in chunk.token_ids]

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))


def parity(a: argparse.Namespace, passthrough: list[str]) -> int:
    """The fixed prompt set of benchmarks/engine/tensor_parallel.py, greedy, through every layout in
    turn; each layout's tokens against the first's (the reference, e.g. 1C). 1 if any differ."""
    from benchmarks.engine.tensor_parallel import NEW_TOKENS, agreement, prompts

    vocab, _ = common.model_vocab(a.model)
    prompt_set = prompts(vocab)
    out = {"model": a.model, "dtype": a.dtype, "engine_args": passthrough, "layouts": {}}
    for name in a.layouts:
        lay, stack = start_layout(a, name, passthrough)
        try:
            stack.start()
            card = ", ".join(sorted({w["card"] for w in serve.describe_workers(stack)}))
            tokens = greedy_tokens(stack.router.address, prompt_set, NEW_TOKENS)
        finally:
            stack.stop()
        out["layouts"][name] = {"label": lay.label(), "card": card, "tokens": tokens}
    ref_name = a.layouts[0]
    ref = out["layouts"][ref_name]["tokens"]
    print(f"== greedy parity, {len(prompt_set)} prompts x {NEW_TOKENS} tokens, {a.dtype}, "
          f"against {out['layouts'][ref_name]['label']} on {out['layouts'][ref_name]['card']}")
    print(f"{'layout':<16}{'identical prompts':>19}{'before 1st diff':>17}{'positions equal':>17}")
    differ = 0
    for r in out["layouts"].values():
        same, prefix, equal = agreement(ref, r["tokens"])
        r.update(identical=same, before_first_difference=prefix, positions_equal=equal)
        differ += same != len(ref)
        print(f"{r['label']:<16}{same:>12}/{len(ref):<6}{prefix:>17.1%}{equal:>17.1%}")
    (a.out_dir / "parity.json").write_text(json.dumps(out, indent=1))
    return 1 if differ else 0


def _rate(x) -> float:
    return float("inf") if x in ("inf", float("inf")) else float(x)


def report(out_dir: Path, slo: tuple[float, float, str] | None = None) -> dict:
    """The table, the best layout per workload, and one goodput-vs-rate plot per workload, from
    every layout-*.json in out_dir. slo = (TTFT ms, ITL ms, per-request ITL statistic):
    goodput recomputed from the per-request rows under these SLOs instead of the run's."""
    layouts = [json.loads(p.read_text()) for p in sorted(out_dir.glob("layout-*.json"))]
    if not layouts:
        raise SystemExit(f"ratio.py: no layout-*.json in {out_dir}")
    if slo is not None:
        for lay in layouts:
            for w, summaries in lay["workloads"].items():
                for s, rows in zip(summaries, lay.get("requests", {}).get(w, [])):
                    good = serve_runs.good_requests(rows, *slo)
                    s["goodput"] = good / s["duration_s"]
                    s["slo_attainment"] = good / s["num_requests"]
                    s["slo"] = {"ttft_ms": slo[0], "itl_ms": slo[1], "per_request_itl": slo[2]}
    cards = sorted({c for lay in layouts for c in lay.get("card", "?").split(", ")})
    rows = []
    for lay in layouts:
        for w, summaries in lay["workloads"].items():
            for s in summaries:
                pulls = s.get("kv_pulls") or {}
                rows.append({"layout": lay.get("label", lay["layout"]), "workload": w,
                             "rate": _rate(s["rate"]),
                             "completed": s["completed"], "num_requests": s["num_requests"],
                             "request_throughput": s["request_throughput"],
                             "output_throughput": s["output_throughput"],
                             "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                             "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
                             "goodput": s["goodput"], "slo_attainment": s["slo_attainment"],
                             "slo": s["slo"], "card": lay.get("card"),
                             "kv_pull_ms": pulls.get("mean_ms"),
                             "kv_pull_mib": pulls.get("mean_mib")})
    rows.sort(key=lambda r: (r["workload"], r["layout"], r["rate"]))
    f = common.fmt
    print(f"== prefill:decode layouts on {', '.join(cards)}; model {layouts[0].get('model')}")
    print(f"{'workload':<14}{'layout':<16}{'rate':>6}{'done':>9}{'req/s':>8}{'out tok/s':>11}"
          f"{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}{'goodput':>9}{'SLO':>6}"
          f"{'KV ms':>8}{'KV MiB':>8}")
    for r in rows:
        print(f"{r['workload']:<14}{r['layout']:<16}{common.fmt_rate(r['rate']):>6}"
              f"{r['completed']:>5}/{r['num_requests']:<3}{f(r['request_throughput'], '.2f'):>8}"
              f"{f(r['output_throughput'], '.0f'):>11}{f(r['ttft_p50_ms'], '.0f'):>10}"
              f"{f(r['ttft_p99_ms'], '.0f'):>9}{f(r['itl_p50_ms']):>9}{f(r['itl_p99_ms']):>8}"
              f"{f(r['goodput'], '.2f'):>9}{f(r['slo_attainment'], '.0%'):>6}"
              f"{f(r['kv_pull_ms']):>8}{f(r['kv_pull_mib']):>8}")
    slo = rows[0]["slo"] if rows else {}
    if slo:
        print(f"(ms; goodput in req/s: TTFT <= {slo['ttft_ms']:g} ms and per-request "
              f"{slo['per_request_itl']} ITL <= {slo['itl_ms']:g} ms; KV: mean time and size of "
              "one request's pull by its decode worker)")
    best = {}
    plots = {}
    from benchmarks.lib.plotting import goodput_vs_rate

    for w in sorted({r["workload"] for r in rows}):
        per = {}
        for r in rows:
            if r["workload"] == w:
                per.setdefault(r["layout"], []).append(r)
        # Finite rates when there are any: at rate inf goodput measures a burst, not a load.
        finite = {lay: [x for x in rs if not math.isinf(x["rate"])] or rs
                  for lay, rs in per.items()}
        score = {lay: (max(x["goodput"] for x in rs),
                       sum(x["goodput"] for x in rs) / len(rs)) for lay, rs in finite.items()}
        winner = max(score, key=score.get)
        best[w] = {"layout": winner, "max_goodput": score[winner][0],
                   "mean_goodput": score[winner][1]}
        print(f"best for {w}: {winner} (goodput up to {score[winner][0]:.2f} req/s)")
        png = out_dir / f"goodput-{w}.png"
        series = {lay: [(x["rate"], x["goodput"]) for x in rs if not math.isinf(x["rate"])]
                  for lay, rs in per.items()}
        why = goodput_vs_rate(series, png, f"{w}: goodput by layout ({', '.join(cards)})")
        plots[w] = str(png) if why is None else why
        print(why or f"wrote {png}")
    out = {"cards": cards, "rows": rows, "best": best, "plots": plots}
    (out_dir / "report.json").write_text(json.dumps(common.strip_private(out), indent=1))
    print(f"wrote {out_dir / 'report.json'}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv, passthrough = common.split_passthrough(sys.argv[1:] if argv is None else list(argv))
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Engine flags after `--` go to every worker.")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs to use (default: all nvidia-smi lists); layouts derive from it")
    p.add_argument("--device-type", choices=["cuda", "cpu"], default=None,
                   help="cpu: every worker on the CPU (a smoke test); default cuda if GPUs")
    p.add_argument("--layouts", nargs="+", default=None,
                   help="e.g. 1P3D 2P2D 4C (default: every split of --gpus and --gpus colocated)")
    p.add_argument("--rates", type=common.parse_rate, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--rates-for", action="append", metavar="WORKLOAD=R,R,...",
                   help="rates for one workload (repeatable), instead of --rates")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--parity", action="store_true",
                   help="greedy parity of a fixed prompt set across --layouts against the first "
                        "(no load runs)")
    p.add_argument("--report-only", action="store_true",
                   help="no runs: table, best layouts and plots from --out-dir")
    p.add_argument("--resummarize", action="store_true",
                   help="with --report-only: recompute goodput under --slo-ttft-ms, "
                        "--slo-itl-ms and --goodput-itl from the stored per-request figures")
    common.add_stack_args(p, devices=False)
    add_workload_args(p, multiple=True)
    serve.add_load_args(p, single_run=False)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    if a.report_only:
        report(a.out_dir, (a.slo_ttft_ms, a.slo_itl_ms, a.goodput_itl) if a.resummarize
               else None)
        return 0
    if not a.model:
        raise SystemExit("ratio.py: --model is required")
    gpus = len(common.cuda_names()) if a.device_type != "cpu" else 0
    a.device_type = a.device_type or ("cuda" if gpus else "cpu")
    a.gpus = a.gpus or gpus or 2
    if a.device_type == "cuda" and a.gpus > gpus:
        raise SystemExit(f"ratio.py: --gpus {a.gpus}, but nvidia-smi lists {gpus}")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    if a.parity:
        if not a.layouts or len(a.layouts) < 2:
            raise SystemExit("ratio.py: --parity needs --layouts REFERENCE LAYOUT ...")
        return parity(a, passthrough)
    failed = 0
    for name in a.layouts or derived_layouts(a.gpus):
        try:
            res = run_layout(a, name, passthrough)
        except RuntimeError as e:  # a stack that did not start; the other layouts still run
            print(f"ratio.py: layout {name} failed: {e}", file=sys.stderr)
            failed += 1
            continue
        failed += sum(s["failed"] for runs in res["workloads"].values() for s in runs)
    report(a.out_dir)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
