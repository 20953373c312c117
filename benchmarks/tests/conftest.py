"""The benchmarks' own tests: their helpers (workload statistics, floors, layouts, recorders,
the NIXL rows' loops) on the CPU. The product's tests (tests/) import nothing from benchmarks/;
these run with them (pytest's testpaths). Triton kernels run under the interpreter when no GPU
is present, as in tests/."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
