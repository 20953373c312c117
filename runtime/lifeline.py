"""A child of a launcher dies with it: SIGTERM when the launcher dies, however it dies, so that
the child drains and exits as on any SIGTERM instead of living on under init with its ports.

The launcher names itself in the child's environment (LIFELINE_ENV); the child, first thing in
`tandem`'s main, asks the kernel for the signal (prctl PR_SET_PDEATHSIG, Linux) and checks the
launcher is still its parent (it may have died before the request took effect). Done in the
child rather than in a preexec_fn: a preexec_fn makes Popen fork() instead of vfork(), and in a
process running gRPC (a test process with clients, a router) fork() restarts gRPC's poller
thread in the child, which then aborts on the descriptors Popen closes before exec
(grpc/grpc#43055: "epoll_wait error: Bad file descriptor", the child gone with SIGABRT before
it ran a line). The kernel ties the signal to the thread that started the child: start a
stack's processes from a thread that lives as long as they should.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LIFELINE_ENV = "TANDEM_LIFELINE_PID"
PR_SET_PDEATHSIG = 1


def lifeline_env() -> dict[str, str]:
    """What a launcher adds to a child's environment."""
    return {LIFELINE_ENV: str(os.getpid())} if sys.platform.startswith("linux") else {}


def hold_lifeline() -> None:
    """In a child: die (SIGTERM) with the launcher named in the environment, if any."""
    pid = os.environ.pop(LIFELINE_ENV, None)
    if pid is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(pid):  # the launcher died before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)
