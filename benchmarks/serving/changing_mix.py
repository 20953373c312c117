"""A changing mix of traffic through one layout of workers: phases of different workloads one
after the other on one stack, goodput per phase and over the whole run; layouts compared in one
table, elastic (roles that change, per-request placement, the planner) against static splits and
colocated workers.

    # one layout per command (a fresh stack each), results to OUT_DIR/layout-<name>.json
    python benchmarks/serving/changing_mix.py --layout 2P2D --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --dtype bfloat16 --out-dir mix
    python benchmarks/serving/changing_mix.py --layout elastic ... --out-dir mix
    # the table of every layout in OUT_DIR, with elastic / best static and elastic / colocated
    python benchmarks/serving/changing_mix.py --report --out-dir mix

Layouts (worker k on GPU k, prefill workers first; every worker on the CPU with --device-type
cpu): <p>P<d>D (static split, the router's default routing policy), <n>C (n colocated workers,
the router balancing), elastic or elastic:<p>P<d>D (that split to start, default 2P2D, run as
`tandem up --elastic` runs it: the router's planner with --planner-ttft/--planner-itl, its
decisions applied by role changes (drain, restart in the other role), and
--routing-policy cost-placement). --placement on adds cost-placement to a static layout.

Phases (--phases, in order, back to back on one clock): WORKLOAD@RATE:SECONDS, Poisson arrivals
at RATE requests/s for SECONDS, workloads from benchmarks/lib/workloads.py (`mixed` is
sharegpt). Greedy, ignore_eos, token ids over gRPC with the load generator of serve.py (its TTFT
and ITL definitions). Goodput: requests per second that finished every token with TTFT <=
--slo-ttft-ms and their own P90 inter-token gap <= --slo-itl-ms (serve.py's rule), over the
phase's own span (its first send to its last finish) and over the whole run; each request
counts in the phase it was sent in. The report recomputes goodput from the stored per-request
rows under the SLOs it is given, so every layout is judged by the same rule.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository first, even when PYTHONPATH already lists it: the script's own directory
# (a benchmarks/ folder) must not shadow a package of the same name.
sys.path.insert(0, str(ROOT))

from benchmarks.lib import common  # noqa: E402
from benchmarks.lib.workloads import WORKLOADS, Request, add_workload_args, build_workload  # noqa: E402
from benchmarks.serving import serve, serve_client, serve_runs  # noqa: E402
from benchmarks.serving.ratio import parse_layout  # noqa: E402

# 8B on four H100/H200-class GPUs (BENCHMARKS "Choosing the prefill:decode ratio": one prefill
# worker saturated by prompt-heavy at 24/s, colocated workers' decodes stalled by long prompts):
# a mixed phase every layout carries, prompt-heavy past two prefill workers' prompt throughput
# (~56k prompt tokens/s: 3P1D's), decode-heavy past one decode worker's batch (~18k output
# tokens/s, kept below what one router process streams: 1P3D's or 2P2D's).
DEFAULT_PHASES = ["mixed@32:30", "prompt-heavy@48:30", "decode-heavy@36:30"]
ALIASES = {"mixed": "sharegpt"}
ELASTIC_BASE = "2P2D"


@dataclass(frozen=True)
class Phase:
    name: str  # as given (mixed, prompt-heavy, ...)
    workload: str  # benchmarks/lib/workloads.py's name
    rate: float  # requests per second, Poisson
    seconds: float

    @property
    def num_requests(self) -> int:
        return max(1, round(self.rate * self.seconds))


def parse_phase(text: str) -> Phase:
    """WORKLOAD@RATE:SECONDS, e.g. prompt-heavy@36:30."""
    name, _, rest = text.partition("@")
    rate, _, seconds = rest.partition(":")
    workload = ALIASES.get(name, name)
    if workload not in WORKLOADS:
        raise SystemExit(f"changing_mix.py: --phases {text!r}: workload {name!r} is not one of "
                         f"{', '.join(sorted({*WORKLOADS, *ALIASES}))}")
    try:
        r, s = float(rate), float(seconds)
    except ValueError:
        raise SystemExit(f"changing_mix.py: --phases {text!r}: use WORKLOAD@RATE:SECONDS, "
                         "e.g. prompt-heavy@36:30") from None
    if not (0 < r < math.inf and 0 < s < math.inf):
        raise SystemExit(f"changing_mix.py: --phases {text!r}: rate and seconds must be > 0 "
                         "and finite")
    return Phase(name, workload, r, s)


@dataclass(frozen=True)
class MixLayout:
    name: str  # as given: 2P2D, 4C, elastic, elastic:1P3D
    roles: list[str]
    devices: list[str]
    elastic: bool
    placement: bool  # --routing-policy cost-placement

    @property
    def label(self) -> str:
        return self.name + ("+placement" if self.placement and not self.elastic else "")

    @property
    def kind(self) -> str:
        """elastic | colocated | static: how the report groups layouts."""
        if self.elastic:
            return "elastic"
        return "colocated" if "both" in self.roles else "static"


def mix_layout(name: str, device_type: str, placement: bool = False) -> MixLayout:
    elastic = name.lower().startswith("elastic")
    base = (name.partition(":")[2] or ELASTIC_BASE) if elastic else name
    lay = parse_layout(base)
    if elastic and ("both" in lay.roles or len(set(lay.tp.values())) > 1
                    or max(lay.tp.values()) > 1):
        raise SystemExit(f"changing_mix.py: --layout {name}: elastic takes a <p>P<d>D split at "
                         "tensor-parallel size 1")
    return MixLayout(name, lay.roles, lay.devices(device_type), elastic, placement or elastic)


# -- the load -------------------------------------------------------------------------------------
def schedule(a: argparse.Namespace, phases: list[Phase], vocab: int
             ) -> tuple[list[Request], list[float], list[int]]:
    """Every phase's requests, their send offsets from the run's start (phase k starts when
    the phases before it have had their seconds), and each request's phase index."""
    requests, offsets, phase_of = [], [], []
    start = 0.0
    for k, ph in enumerate(phases):
        a.workload, a.num_requests = ph.workload, ph.num_requests
        reqs = build_workload(a, vocab, seed=a.seed + k)
        offs = serve_runs.arrival_offsets(len(reqs), ph.rate, a.seed + 1000 * (k + 1))
        requests += reqs
        offsets += [start + o for o in offs]
        phase_of += [k] * len(reqs)
        start += ph.seconds
    return requests, offsets, phase_of


def request_rows(results: list[serve_client.Result], phase_of: list[int]) -> list[dict]:
    """Per request: enough to recompute goodput under any SLOs (serve_runs.good_requests), its
    phase, and its send and finish times from the run's start."""
    t0 = min(r.sent for r in results if r.sent)
    return [{"phase": k, "sent_s": r.sent - t0 if r.sent else None,
             "end_s": r.sent - t0 + r.e2e if r.sent and r.e2e is not None else None,
             "prompt_len": r.prompt_len, "output_tokens": r.tokens,
             "expected_tokens": r.expected_tokens, "ok": r.ok,
             "ttft_ms": None if r.ttft is None else r.ttft * 1e3,
             **{f"itl_{s}_ms": common.itl_stat(r.itls, s) * 1e3 for s in common.ITL_STATS},
             "error": r.error}
            for r, k in zip(results, phase_of)]


def span_s(rows: list[dict]) -> float:
    """First send to last finish of these requests (NaN when none finished)."""
    sent = [r["sent_s"] for r in rows if r["sent_s"] is not None]
    ends = [r["end_s"] for r in rows if r["end_s"] is not None]
    return max(ends) - min(sent) if sent and ends else float("nan")


def goodput(rows: list[dict], slo: tuple[float, float, str]) -> dict:
    """Goodput of these requests over their own span, under slo = (TTFT ms, ITL ms, which of a
    request's own gaps)."""
    good = serve_runs.good_requests([r for r in rows if r["ttft_ms"] is not None], *slo)
    dur = span_s(rows)
    return {"requests": len(rows), "good": good, "span_s": dur,
            "goodput": good / dur if dur > 0 else 0.0,
            "attainment": good / len(rows) if rows else 0.0}


# -- elastic: the planner followed, as `tandem up --elastic` follows it ---------------------------
class Follower:
    """The supervisor (role changes) and cli/elastic.py's Elastic, checked once a second in a
    thread, with what the planner said and every change timed from `t0`."""

    def __init__(self, stack, windows: int, t0: float) -> None:
        from tandem.cli.elastic import Elastic, fetch_metrics, parse_metrics
        from tandem.cli.supervisor import Supervisor

        self.t0 = t0
        self.readings: list[dict] = []
        self.supervisor = Supervisor(stack, say=self.say).start()
        last = [None]

        def fetch(url: str) -> str:
            text = fetch_metrics(url)
            r = parse_metrics(text)
            if r is not None and r.windows != last[0]:
                last[0] = r.windows
                self.readings.append({"t_s": self.now(), "window": r.windows,
                                      "desired_prefill": r.desired.prefill,
                                      "desired_decode": r.desired.decode,
                                      "prefill": len(stack.workers("prefill")),
                                      "decode": len(stack.workers("decode"))})
            return text

        url = f"http://127.0.0.1:{stack.router.http_port}/metrics"
        # Zero prefill workers allowed: the router's prefill fallback serves decode workers alone.
        self.elastic = Elastic(self.supervisor, url, windows, 0, say=self.say, fetch=fetch)
        self._asked: list[float] = []  # when each role change was asked for
        self._ended: list[float] = []  # when each ended (done or given up)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elastic", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, msg: str) -> None:
        print(f"  [{self.now():6.1f} s] elastic: {msg}", flush=True)

    def _loop(self) -> None:
        next_look = 0.0
        while not self._stop.wait(0.2):
            if time.monotonic() >= next_look:  # a planner window is seconds long
                next_look = time.monotonic() + 1.0
                if self.elastic.check() is not None:
                    self._asked.append(self.now())
            while len(self._ended) < len(self.supervisor.conversions):
                self._ended.append(self.now())

    def stop(self) -> list[dict]:
        """Stop following; every role change as it went (asked_s, ended_s: from t0), the one
        still under way last (ended_s None)."""
        self._stop.set()
        self._thread.join()
        changes = list(self.supervisor.conversions)
        if self.supervisor.conversion is not None:
            changes.append(self.supervisor.conversion)
        ended = self._ended + [None] * len(changes)
        return [{"worker": c.name, "became": c.new_name, "role": c.role, "reason": c.reason,
                 "done": c.done, "failed": c.failed, "moved": c.moved, "finished": c.finished,
                 "left": c.left, "asked_s": asked, "ended_s": end,
                 # How it went (cli/supervisor.py): in place, or by a restart; its drain and
                 # the whole change, from the supervisor's marks.
                 "in_place": bool(c.switched_to), "drain_s": _span(c.asked_at, c.drained_at),
                 "change_s": _span(c.asked_at, c.ready_at)}
                for c, asked, end in zip(changes, self._asked, ended)]


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


# -- one layout ----------------------------------------------------------------------------------
def router_flags(a: argparse.Namespace, lay: MixLayout, passthrough: list[str],
                 num_requests: int) -> list[str]:
    out = serve.router_args(a, passthrough, num_requests)
    if lay.placement:
        out += ["--routing-policy", "cost-placement"]
    if lay.elastic:
        out += ["--planner-ttft", str(a.planner_ttft), "--planner-itl", str(a.planner_itl),
                "--planner-interval", str(a.planner_interval)]
    return out


def run_layout(a: argparse.Namespace, lay: MixLayout, phases: list[Phase],
               passthrough: list[str]) -> dict:
    from tandem.cli.launcher import LocalStack

    vocab, model_max = common.model_vocab(a.model)
    requests, offsets, phase_of = schedule(a, phases, vocab)
    common.check_lengths(requests, min(a.max_model_len, model_max))
    warm = []  # shaped like every phase: each kind of step compiled before the clock starts
    for ph in phases:
        a.workload = ph.workload
        warm += common.warmup_requests(a, vocab)
    stack = LocalStack(a.model, lay.roles, lay.devices,
                       worker_args=serve.common_worker_args(a, passthrough),
                       router_args=["--grpc-port", "0", "--http-port", "0",
                                    *router_flags(a, lay, passthrough, len(requests))],
                       log_dir=a.log_dir / lay.label.replace(":", "_") if a.log_dir else None,
                       env=serve.launch_env(), metrics=True, elastic=lay.elastic)
    print(f"== {lay.label}: {', '.join(f'{r}@{d}' for r, d in zip(lay.roles, lay.devices))}; "
          f"{len(requests)} requests in {len(phases)} phases; logs in {stack.log_dir}",
          flush=True)
    out = {"layout": lay.name, "label": lay.label, "kind": lay.kind, "roles": lay.roles,
           "devices": lay.devices, "model": a.model, "dtype": a.dtype,
           "engine_args": passthrough, "router_args": stack.router_args,
           "phases": [vars(p) for p in phases], "environment": common.environment(),
           "slo": {"ttft_ms": a.slo_ttft_ms, "itl_ms": a.slo_itl_ms,
                   "per_request_itl": a.goodput_itl},
           "command": " ".join(["benchmarks/serving/changing_mix.py", *a.argv])}
    follower = None
    t = time.perf_counter()
    try:
        stack.start()
        out["startup_s"] = time.perf_counter() - t
        out["workers"] = serve.describe_workers(stack)
        out["card"] = ", ".join(sorted({w["card"] for w in out["workers"]}))
        print(f"   up in {out['startup_s']:.1f} s on {out['card']}", flush=True)
        opts = serve_client.LoadOptions(
            api="grpc", target=stack.router.address, channels=a.channels,
            request_timeout=a.request_timeout, slo_ttft_ms=a.slo_ttft_ms,
            slo_itl_ms=a.slo_itl_ms, goodput_itl=a.goodput_itl,
            client_procs=a.client_procs or serve.default_client_procs(), progress=a.progress)
        if warm:
            w, _ = serve_client.send_all(opts, warm, [0.0] * len(warm), f"{lay.label} warmup")
            bad = [r.error for r in w if r.error]
            if bad:
                raise RuntimeError(f"warm-up requests failed: {bad[:3]}")
        if lay.elastic:
            follower = Follower(stack, a.elastic_windows, time.monotonic())
        results, client_cpu_s = serve_client.send_all(opts, requests, offsets, lay.label)
        out["client_cpu_s"] = client_cpu_s
        out["requests"] = request_rows(results, phase_of)
        out["errors"] = [r.error for r in results if r.error][:5]
    finally:
        if follower is not None:
            out["planner"] = follower.readings
            out["role_changes"] = follower.stop()
        out["exit_codes"] = stack.stop()
    return out


# -- the report ----------------------------------------------------------------------------------
def summarize(run: dict, slo: tuple[float, float, str]) -> dict:
    """Goodput per phase (by name) and over the run ("all") under `slo`."""
    rows = run.get("requests") or []
    per = {ph["name"]: goodput([r for r in rows if r["phase"] == k], slo)
           for k, ph in enumerate(run["phases"])}
    return {**per, "all": goodput(rows, slo)}


def ratios(runs: list[dict], slo: tuple[float, float, str]) -> dict:
    """Whole-run goodput per layout; each elastic layout's against the best static split and
    the best colocated layout."""
    whole = {r["label"]: summarize(r, slo)["all"]["goodput"] for r in runs}
    kind = {r["label"]: r["kind"] for r in runs}

    def best(k: str) -> tuple[str, float] | None:
        cands = {lab: g for lab, g in whole.items() if kind[lab] == k}
        return max(cands.items(), key=lambda kv: kv[1]) if cands else None

    static, colocated = best("static"), best("colocated")
    out = {"goodput": whole, "best_static": static, "best_colocated": colocated, "elastic": {}}
    for lab, g in whole.items():
        if kind[lab] != "elastic":
            continue
        out["elastic"][lab] = {
            "vs_best_static": g / static[1] if static and static[1] > 0 else None,
            "vs_colocated": g / colocated[1] if colocated and colocated[1] > 0 else None}
    return out


def report(out_dir: Path, slo: tuple[float | None, float | None, str]) -> dict:
    """The table of every finished layout-*.json in out_dir, goodput under `slo`: the SLOs
    the first run stored where one is None."""
    runs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("layout-*.json"))]
    runs = [r for r in runs if r.get("requests")]
    if not runs:
        raise SystemExit(f"changing_mix.py: no finished layout-*.json in {out_dir}")
    stored = runs[0].get("slo") or {"ttft_ms": 1000.0, "itl_ms": 50.0}
    slo = (stored["ttft_ms"] if slo[0] is None else slo[0],
           stored["itl_ms"] if slo[1] is None else slo[1], slo[2])
    phases = [p["name"] for p in runs[0]["phases"]]
    differ = [r["label"] for r in runs if [p["name"] for p in r["phases"]] != phases
              or r["phases"] != runs[0]["phases"]]
    cards = sorted({r.get("card", "?") for r in runs})
    print(f"== changing mix on {'; '.join(cards)}; model {runs[0].get('model')}; phases "
          + ", ".join(f"{p['name']} {p['rate']:g}/s x {p['seconds']:g} s"
                      for p in runs[0]["phases"]))
    if differ:
        print(f"WARNING: {', '.join(differ)} ran other phases than {runs[0]['label']}")
    head = "".join(f"{p:>14}" for p in phases)
    print(f"{'layout':<20}{head}{'whole run':>12}{'in SLO':>8}{'failed':>8}{'start s':>9}")
    rows = []
    for r in runs:
        s = summarize(r, slo)
        failed = sum(1 for q in r["requests"] if not q["ok"])
        rows.append({"label": r["label"], "kind": r["kind"], "card": r.get("card"),
                     "startup_s": r.get("startup_s"), "failed": failed,
                     "role_changes": len(r.get("role_changes") or []), **s})
        cells = "".join(f"{s[p]['goodput']:>8.2f} ({s[p]['attainment']:>4.0%})" for p in phases)
        print(f"{r['label']:<20}{cells}{s['all']['goodput']:>12.2f}{s['all']['attainment']:>8.0%}"
              f"{failed:>8}{common.fmt(r.get('startup_s')):>9}")
    print(f"(goodput in req/s over each phase's span, (share of its requests within the SLOs): "
          f"TTFT <= {slo[0]:g} ms and per-request {slo[2]} ITL <= {slo[1]:g} ms)")
    rat = ratios(runs, slo)
    for name, k in (("best static split", "best_static"), ("best colocated", "best_colocated")):
        best = rat[k]
        print(f"{name}: " + (f"{best[0]} ({best[1]:.2f} req/s)" if best else "none run"))
    for lab, v in rat["elastic"].items():
        print(f"{lab}: {common.fmt(v['vs_best_static'], '.2f')}x the best static split, "
              f"{common.fmt(v['vs_colocated'], '.2f')}x colocated (acceptance: >= 1.3x each)")
    for r in runs:
        for c in r.get("role_changes") or []:
            print(f"  {r['label']} role change: {c['worker']} -> {c.get('became') or '?'} "
                  f"asked at {common.fmt(c.get('asked_s'))} s, ended at "
                  f"{common.fmt(c.get('ended_s'))} s"
                  f"{'' if c['done'] else ' (not done: ' + (c.get('failed') or 'under way') + ')'} "
                  + (f"{'in place' if c.get('in_place') else 'by restart'} in "
                     f"{common.fmt(c.get('change_s'), '.2f')} s, drained in "
                     f"{common.fmt(c.get('drain_s'), '.2f')} s " if c.get("change_s") is not None
                     else "")
                  + f"({c['reason']})")
    out = {"slo": {"ttft_ms": slo[0], "itl_ms": slo[1], "per_request_itl": slo[2]},
           "cards": cards, "phases": runs[0]["phases"], "rows": rows, "ratios": rat}
    (out_dir / "report.json").write_text(json.dumps(common.strip_private(out), indent=1))
    print(f"wrote {out_dir / 'report.json'}")
    return out


# -- command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1]
                                + "\nEngine flags after `--` go to every worker.")
    p.add_argument("--layout", help="4C, 1P3D, 2P2D, 3P1D, elastic, elastic:1P3D, ...")
    p.add_argument("--placement", choices=["on", "off"], default="off",
                   help="on: --routing-policy cost-placement for a static layout too "
                        "(elastic always has it)")
    p.add_argument("--device-type", choices=["cuda", "cpu"], default=None,
                   help="default cuda when nvidia-smi lists GPUs")
    p.add_argument("--phases", nargs="+", default=DEFAULT_PHASES,
                   help=f"WORKLOAD@RATE:SECONDS ... (default {' '.join(DEFAULT_PHASES)})")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--report", action="store_true",
                   help="no run: the table of every layout-*.json in --out-dir")
    g = p.add_argument_group("elastic")
    g.add_argument("--planner-ttft", type=float, default=0.5,
                   help="the planner's TTFT target, seconds (p90 of each window)")
    g.add_argument("--planner-itl", type=float, default=0.02,
                   help="the planner's ITL target, seconds (p90 of each window)")
    g.add_argument("--planner-interval", type=float, default=5.0, help="seconds per window")
    g.add_argument("--elastic-windows", type=int, default=2,
                   help="windows in a row that must want the same role change")
    common.add_stack_args(p, devices=False)
    add_workload_args(p)
    serve.add_load_args(p, single_run=False)
    # SLOs: BENCHMARKS' for 8B (TTFT 1 s, ITL 50 ms) for a run; --report: the runs' own unless
    # given. A request still running a minute after it was sent cannot meet them, and cutting
    # it keeps an overloaded layout's run within its time.
    p.set_defaults(slo_ttft_ms=None, slo_itl_ms=None, request_timeout=60.0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    argv, passthrough = common.split_passthrough(raw)
    a = build_parser().parse_args(argv)
    a.argv = raw
    if a.report:
        report(a.out_dir, (a.slo_ttft_ms, a.slo_itl_ms, a.goodput_itl))
        return 0
    a.slo_ttft_ms = 1000.0 if a.slo_ttft_ms is None else a.slo_ttft_ms
    a.slo_itl_ms = 50.0 if a.slo_itl_ms is None else a.slo_itl_ms
    slo = (a.slo_ttft_ms, a.slo_itl_ms, a.goodput_itl)
    if not a.layout or not a.model:
        raise SystemExit("changing_mix.py: --layout and --model are required (or --report)")
    phases = [parse_phase(t) for t in a.phases]
    a.device_type = a.device_type or ("cuda" if common.cuda_names() else "cpu")
    lay = mix_layout(a.layout, a.device_type, a.placement == "on")
    if a.device_type == "cuda" and len(lay.devices) > len(common.cuda_names()):
        raise SystemExit(f"changing_mix.py: {lay.name} needs {len(lay.devices)} GPUs")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    path = a.out_dir / f"layout-{lay.label.replace(':', '_')}.json"
    res = run_layout(a, lay, phases, passthrough)
    path.write_text(json.dumps(common.strip_private(res), indent=1))
    print(f"wrote {path}")
    s = summarize(res, slo)
    for name, g in s.items():
        print(f"  {name:<14} goodput {g['goodput']:7.2f} req/s ({g['attainment']:.0%} of "
              f"{g['requests']} within the SLOs) over {g['span_s']:.1f} s")
    failed = sum(1 for q in res.get("requests", []) if not q["ok"])
    return 1 if failed or not res.get("requests") else 0


if __name__ == "__main__":
    sys.exit(main())
