"""Process lifetimes: child processes live and die with the process that owns them.

Children (engine cores, ranks, EMS processes of a stack) must not act on the signals a
terminal or a process manager sends to the whole process group (Ctrl-C's SIGINT, `timeout`'s
SIGTERM): their owner drains and then stops them in order. They still go when the owner goes:
ranks and cores see their pipe close; EMS processes get a SIGTERM from the kernel when the
owning process dies (Linux PR_SET_PDEATHSIG), which they answer by flushing and exiting.
"""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def ignore_group_signals() -> None:
    """In a child whose owner manages its lifetime (engine core, rank)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """A subprocess.Popen preexec_fn: the child gets `sig` when its parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass  # not Linux: the owner's shutdown still stops it
