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
import threading

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


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Event:
    """Exit this process (os._exit) once `parent_pid` is gone, until the returned event is set.
    For a child busy in work that reads no pipe (an engine core compiling at start-up): a
    watcher thread sees it reparented. Not PR_SET_PDEATHSIG: that fires when the spawning
    *thread* ends, and front ends start cores from worker threads too."""
    import os

    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
    return done
