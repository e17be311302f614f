"""No orphans: every process a megareason command starts dies with it, also when it is SIGKILLed.

A command that starts processes (a local Ray cluster, vLLM engines inside the Ray workers, reward workers,
a verifier server) calls ``reap_descendants_on_exit()`` first. That starts a small watcher process
(``python -m megareason.launch.reaper PID``, in its own session so a Ctrl-C to the terminal does not reach
it) that, twice a second, records every descendant of the command's process by (pid, start time). When the
command's process is gone (exited, killed, or a zombie), the watcher sends SIGTERM to every recorded
process still alive, and to their descendants, then SIGKILL to those left 3 s later, and exits.

Why a watcher: once the command's process dies, its children are re-parented to init and the tree that
linked them to it is lost (Ray's dashboard and runtime-env agents, and the vLLM engine core of a Ray
worker, outlive a SIGKILLed driver by minutes, as measured). ``PR_SET_PDEATHSIG`` only reaches
direct children the command forks itself, and Ray and vLLM start most of these. Recording (pid, start time)
means a recycled pid is never killed (the process table through psutil). Linux only; elsewhere the call does
nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megareason.utils import alive, descendants, proc_stat, process_table

_POLL_S = 0.5
_GRACE_S = 3.0
_started: set[int] = set()  # pids whose watcher is running (one per process)


def reap_descendants_on_exit() -> None:
    """Start the watcher for this process (once per process; Linux only)."""
    me = os.getpid()
    if me in _started or not Path("/proc/self/stat").exists():
        return
    subprocess.Popen([sys.executable, "-m", "megareason.launch.reaper", str(me)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _started.add(me)


def _signal(procs: dict[int, int], sig: int) -> None:
    for pid, start in procs.items():
        if alive(pid, start):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def watch(parent: int) -> None:
    """The watcher's loop (module docstring)."""
    me, first = os.getpid(), proc_stat(parent)
    if first is None:
        return
    recorded: dict[int, int] = {}
    while alive(parent, first[2]):
        recorded.update(descendants({parent}, process_table()))
        recorded.pop(me, None)
        time.sleep(_POLL_S)
    # Gone: what it left, and anything those started since (their tree survives the re-parenting).
    table = process_table()
    recorded = {p: s for p, s in recorded.items() if alive(p, s)}
    recorded.update(descendants(set(recorded) | {parent}, table))
    recorded.pop(me, None)
    _signal(recorded, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    while time.monotonic() < deadline and any(alive(p, s) for p, s in recorded.items()):
        time.sleep(0.1)
    _signal(recorded, signal.SIGKILL)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]))
