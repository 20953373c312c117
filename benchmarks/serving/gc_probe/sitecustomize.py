"""The garbage-collection probe of benchmarks/serving/gc_pauses.py: imported at start by every
Python process that has this folder on PYTHONPATH and GCPROBE_DIR set, it writes each cyclic
collection of that process (generation, milliseconds, wall-clock end) to GCPROBE_DIR/<pid>.tsv,
after a first line naming the process's command."""

import gc
import os
import sys
import time

_DIR = os.environ.get("GCPROBE_DIR")
if _DIR:
    _out = open(os.path.join(_DIR, f"{os.getpid()}.tsv"), "w", buffering=1)  # noqa: SIM115
    _out.write("# " + " ".join(sys.orig_argv)[:300] + "\n")
    _began = [0.0]

    def _record(phase: str, info: dict) -> None:
        if phase == "start":
            _began[0] = time.perf_counter()
        else:
            ms = (time.perf_counter() - _began[0]) * 1e3
            _out.write(f"{info['generation']}\t{ms:.3f}\t{time.time():.3f}\n")

    gc.callbacks.append(_record)
