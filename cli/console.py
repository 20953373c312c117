"""`tandem up`'s own output, which may go away while the stack runs: a pipe whose reader left
(`tandem up | head -n 2`, or `| tee log` stopped by Ctrl-C) or a terminal that hung up.

A write to such an output fails (EPIPE; Python ignores SIGPIPE and raises BrokenPipeError
instead). Left alone, that error would end `tandem up` with a traceback before it stopped its
processes, and kill the threads that copy the processes' output, whose pipes would then fill
and block them. Here a lost output is sent to /dev/null instead, and `gone()` says so, so that
`tandem up` can stop the stack in order (as on SIGTERM) instead of dying.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from typing import TextIO


class Console:
    def __init__(self) -> None:
        self._lost = threading.Event()

    def install(self) -> Console:
        """Guard this process's stdout and stderr (sys.stdout, sys.stderr)."""
        sys.stdout = _Guarded(sys.stdout, self._lost)  # type: ignore[assignment]
        sys.stderr = _Guarded(sys.stderr, self._lost)  # type: ignore[assignment]
        return self

    def gone(self) -> bool:
        """Whether stdout is lost: a write to it failed, or it is a pipe whose reader closed
        it or a terminal that hung up (poll reports POLLERR / POLLHUP without a write)."""
        if self._lost.is_set():
            return True
        try:
            fd = sys.__stdout__.fileno() if sys.__stdout__ else -1
        except (OSError, ValueError):
            return False
        if fd < 0:
            return False
        poller = select.poll()
        poller.register(fd, 0)  # no events asked: POLLERR and POLLHUP are always reported
        if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
            _to_devnull(fd)
            self._lost.set()
        return self._lost.is_set()


class _Guarded:
    """A text stream whose writes never raise for a lost output: it goes to /dev/null."""

    def __init__(self, stream: TextIO, lost: threading.Event) -> None:
        self._stream = stream
        self._lost = lost

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (BrokenPipeError, ConnectionResetError):
            self._lose()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._lose()

    def _lose(self) -> None:
        self._lost.set()
        _to_devnull(self._stream.fileno())
        # What the stream still buffers now goes to /dev/null too.
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _to_devnull(fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
