"""Shared test setup. Triton kernels run under the interpreter when no GPU is present; the
variable must be set before any kernel module is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
