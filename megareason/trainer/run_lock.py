"""The run folder's lock (``run_dir.hold_run_lock``): one writer per run folder, on any file system, and never
a stale lock in the way of the job that left it.

* Where ``flock`` works, an exclusive, non-blocking ``flock`` on ``<run>/.lock``, held for the process's life:
  the kernel drops it when the process dies, however it dies.
* Where it does not — Lustre mounted ``noflock`` answers ENOSYS, NFS without a lock manager ENOLCK, some FUSE
  and object-store mounts EOPNOTSUPP — an exclusive-create file ``<run>/.lock.held`` (``O_CREAT | O_EXCL``, atomic
  on every POSIX file system), removed when the process exits normally. A process killed outright leaves it
  behind; so does a ``flock`` held by the kernel of a node that crashed, until the file server expires it.

Both files hold the holder: ``pid P on HOST, Slurm job J (restart R), since TIME`` and, on a second line, the
same as JSON. A holder that is provably gone is taken over (``stale``), naming why:

* the same Slurm job at an earlier restart (``SLURM_RESTART_COUNT``): Slurm requeues a job only after every
  step of its earlier run ended, on whichever nodes are left, so the requeue of a job whose node crashed is
  never refused by that node's lock;
* on this host, a PID that no longer runs (or now belongs to a later process: its start time differs);
* another Slurm job that ``squeue`` no longer lists, or lists in a final state.

A holder on another host outside Slurm cannot be checked from here: the error says which file to remove once
that process is known to be gone.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from megareason.config import ConfigError

# flock's errors that mean "this file system does not lock", not "someone holds it"
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
HELD = ".lock.held"
# squeue's states of a job that will not run again (squeue lists a finished job for MinJobAge, 300 s by default)
FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "TIMEOUT"}


class RunFolderBusy(ConfigError):
    """Another live process holds the run folder's lock (``run_dir.hold_run_lock``)."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    job: str | None  # SLURM_JOB_ID
    restart: int  # SLURM_RESTART_COUNT
    started: float | None  # the process's start time (psutil's create_time), to tell a reused PID
    since: str

    def text(self) -> str:
        job = f", Slurm job {self.job} (restart {self.restart})" if self.job else ""
        return f"pid {self.pid} on {self.host}{job}, since {self.since}\n{json.dumps(asdict(self))}\n"

    @property
    def shown(self) -> str:
        return self.text().splitlines()[0]


def this_process(env: dict[str, str] | None = None) -> Holder:
    import psutil

    env = os.environ if env is None else env
    return Holder(pid=os.getpid(), host=socket.gethostname(), job=env.get("SLURM_JOB_ID") or None,
                  restart=int(env.get("SLURM_RESTART_COUNT") or 0), started=psutil.Process().create_time(),
                  since=time.strftime("%Y-%m-%d %H:%M:%S"))


def parse(text: str) -> Holder | None:
    """The holder a lock file names (None: empty, or written by another version)."""
    for line in text.splitlines()[1:2]:
        try:
            return Holder(**json.loads(line))
        except (ValueError, TypeError):
            return None
    return None


def squeue_state(job: str) -> str | None:
    """The job's state as ``squeue`` lists it, "" when it lists none (gone), None when squeue cannot be asked."""
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode:
        return "" if "Invalid job id" in proc.stderr else None
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""


def stale(holder: Holder | None, me: Holder, state: Callable[[str], str | None] = squeue_state) -> str | None:
    """Why ``holder``'s lock no longer protects anything (module docstring), None when it may still be held."""
    if holder is None:
        return None
    if holder.job and holder.job == me.job and holder.restart < me.restart:
        return (f"it was this Slurm job's run before its requeue (restart {holder.restart}; this is restart "
                f"{me.restart})")
    if holder.host == me.host:
        import psutil

        try:
            started = psutil.Process(holder.pid).create_time()
        except psutil.Error:
            return f"pid {holder.pid} no longer runs on {me.host}"
        if holder.started is not None and abs(started - holder.started) > 1:
            return f"pid {holder.pid} on {me.host} is another process now (started later)"
        return None
    if holder.job and holder.job != me.job:
        found = state(holder.job)
        if found == "":
            return f"Slurm job {holder.job} is no longer running (squeue lists none)"
        if found in FINAL_STATES:
            return f"Slurm job {holder.job} is {found}"
    return None


def take(root: Path, env: dict[str, str] | None = None, state: Callable[[str], str | None] = squeue_state) -> int:
    """Lock the run folder ``root`` (it exists) for this process (module docstring); returns the descriptor of
    ``root/.lock`` to keep open. Raises ``RunFolderBusy`` naming the holder."""
    me = this_process(env)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        flocked = True
    except BlockingIOError:
        text = os.read(fd, 4096).decode(errors="replace")
        why = stale(parse(text), me, state)
        if why is None:
            os.close(fd)
            raise RunFolderBusy(f"{root} is in use by another run ({_first(text)}); wait for it to end or set "
                                "another trainer.output_dir") from None
        # a flock that no live process holds: a crashed node's, kept by the file server until it expires
        print(f"megareason: {root}/.lock is held by {_first(text)}, gone: {why}; taking the run folder "
              f"over with {HELD}", file=sys.stderr)
        flocked = False
    except OSError as e:
        if e.errno not in NO_FLOCK:
            os.close(fd)
            raise
        flocked = False
    try:
        _take_held(root / HELD, me, state, required=not flocked)
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, me.text().encode(), 0)
    return fd


def _take_held(path: Path, me: Holder, state: Callable[[str], str | None], required: bool) -> None:
    """Create ``path`` exclusively for ``me``, taking over a stale holder's; with ``required`` False (``flock``
    holds the folder) only a live holder's is an error, a stale one is removed, and none is created."""
    for _ in range(3):
        if path.exists():
            text = _read(path)
            why = stale(parse(text), me, state)
            if why is None:
                raise RunFolderBusy(f"{path.parent} is in use by another run ({_first(text)}; "
                                    f"its lock {path}, kept where flock does not work: remove it once that run is "
                                    "known to be gone); wait for it to end or set another trainer.output_dir")
            # aside under a name of our own first: of two processes breaking it, one renames it, the other retries
            aside = path.with_name(f"{HELD}.stale.{me.pid}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            aside.unlink(missing_ok=True)
            print(f"megareason: {path} named {_first(text)}, gone: {why}; removed", file=sys.stderr)
            continue
        if not required:
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me.text())
        atexit.register(_release, path, me.pid)
        return
    raise RunFolderBusy(f"{path.parent}: its lock {path} keeps changing hands; another run is starting there")


def _release(path: Path, pid: int) -> None:
    holder = parse(_read(path))
    if os.getpid() == pid and holder is not None and holder.pid == pid:
        path.unlink(missing_ok=True)


def _first(text: str) -> str:
    return text.splitlines()[0] if text.strip() else "unknown"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
