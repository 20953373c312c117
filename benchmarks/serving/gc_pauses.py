"""Python's garbage-collection pauses in every process of a served run: `serve.py --launch ...`
run with a probe (gc_probe/sitecustomize.py) in each process it starts, then, per process
(router, worker front, engine core, the client), the collections after the stack was ready (the
router's ready file), by generation: how many, their total and largest pause.

    python benchmarks/serving/gc_pauses.py -- --launch colocated --model M --devices cpu \\
        --dtype float32 --workload fixed --prompt-len 64 --output-len 64 --num-requests 500

Everything after `--` goes to serve.py (give no --log-dir or --out: this script sets them).
A full collection walks every object the process tracks, so its pause stalls what that process
serves at that moment: every stream of the router, every sequence of an engine's step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def kind_of(command: str) -> str:
    """Which process a command line is: `tandem router` / `tandem worker` by the subcommand's
    word (a router's --workers flag names workers too)."""
    words = command.split()
    if "--multiprocessing-fork" in words:
        return "engine core"
    for word, kind in (("tandem.engine.tp_group", "tensor-parallel rank"),
                       ("router", "router"), ("worker", "worker")):
        if word in words:
            return kind
    return "client" if any(w.endswith("serve.py") for w in words) else "other"


def summarize(probe_dir: Path, since: float) -> list[dict]:
    """Per probed process: its kind, command, and by generation the collections that ended
    after `since` (wall clock): count, total ms, largest ms."""
    rows = []
    for f in sorted(probe_dir.glob("*.tsv")):
        lines = f.read_text().splitlines()
        if not lines:
            continue
        command = lines[0].removeprefix("# ")
        gens: dict[int, list[float]] = {0: [], 1: [], 2: []}
        for line in lines[1:]:
            gen, ms, at = line.split("\t")
            if float(at) >= since:
                gens[int(gen)].append(float(ms))
        rows.append({"pid": int(f.stem), "kind": kind_of(command), "command": command,
                     **{f"gen{g}": {"n": len(v), "total_ms": round(sum(v), 3),
                                    "max_ms": round(max(v, default=0.0), 3)}
                        for g, v in gens.items()}})
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="the summary as JSON")
    a = p.parse_args(argv[:cut])
    serve_args = argv[cut + 1:]
    # Ours before serve.py's own `--` (the engine flags after it).
    at = serve_args.index("--") if "--" in serve_args else len(serve_args)
    with tempfile.TemporaryDirectory(prefix="gc-pauses-") as tmp:
        probe, logs = Path(tmp) / "probe", Path(tmp) / "logs"
        probe.mkdir()
        env = {**os.environ, "GCPROBE_DIR": str(probe),
               "PYTHONPATH": os.pathsep.join([str(HERE / "gc_probe"),
                                              os.environ.get("PYTHONPATH", "")])}
        serve = [sys.executable, str(HERE / "serve.py"), *serve_args[:at], "--log-dir",
                 str(logs), "--out", str(Path(tmp) / "serve.json"), *serve_args[at:]]
        done = subprocess.run(serve, env=env, check=False)
        if done.returncode:
            sys.exit(f"serve.py exited with {done.returncode}")
        ready = (logs / "router.ready").stat().st_mtime
        rows = summarize(probe, ready)
        run = json.loads((Path(tmp) / "serve.json").read_text())["runs"][0]["summary"]
    print(f"{'process':<22}{'gen 0':>16}{'gen 1':>16}{'gen 2 (full)':>22}")
    for r in sorted(rows, key=lambda r: r["kind"]):
        cells = [f"{r[g]['n']} / {r[g]['total_ms']:.0f} ms" for g in ("gen0", "gen1")]
        full = r["gen2"]
        print(f"{r['kind']:<22}{cells[0]:>16}{cells[1]:>16}"
              f"{full['n']:>6} / {full['total_ms']:.0f} ms, max {full['max_ms']:.0f}")
    print(f"(collections after the stack was ready: count / total ms; the run: "
          f"{run['output_throughput']:.0f} output tok/s, ITL p99 {run['itl_ms']['p99']:.1f} ms)")
    if a.out:
        Path(a.out).write_text(json.dumps({"processes": rows, "run": run}, indent=1))


if __name__ == "__main__":
    main()
