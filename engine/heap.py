"""A serving process and Python's garbage collector."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Once a process serves: everything it built to start (modules, the model and its engine,
    its servers) collected once, then moved out of the cyclic collector's sight (gc.freeze).
    A full collection then walks only what serving made since, where it walked the whole heap
    (~300k objects in a process holding torch, transformers or FastAPI): 100-250 ms on a CPU of
    the test VM, every step or every stream of the process stalled meanwhile, a few times in a
    thousand-request burst. For processes that build their engine or servers once: an object
    frozen here that turns into garbage later (the kv connector an engine's role change
    replaces) is never collected; what holds memory outside Python is closed explicitly."""
    gc.collect()
    gc.freeze()
