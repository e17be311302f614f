"""Small helpers shared across modules."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (for torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replace_directory(tmp: Path, target: Path) -> None:
    """Move the finished directory ``tmp`` to ``target`` by renames, replacing an older ``target`` only
    once the new one is complete (a crash leaves the old or the new one, never a mix)."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Write a directory atomically: fill the yielded temporary directory (beside ``target``, so the
    final rename stays on one file system); on success it becomes ``target``, on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        replace_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# Processes by (pid, start time), from /proc (Linux): launch/reaper.py, rollout/engine.py.


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks since boot) of ``pid``, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces or ")"
    return int(fields[1]), fields[0], int(fields[19])


def process_table() -> dict[int, tuple[int, str, int]]:
    """Every process: pid -> (parent pid, state, start time)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := proc_stat(int(entry))) is not None:
            out[int(entry)] = st
    return out


def descendants(roots: set[int], table: dict[int, tuple[int, str, int]]) -> dict[int, int]:
    """Every process in ``table`` below one of ``roots`` (pid -> start time), roots excluded."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child not in roots:
                found[child] = table[child][2]
                todo.append(child)
    return found


def alive(pid: int, start: int) -> bool:
    """``pid`` still runs the process that started at ``start`` (not a zombie, not a recycled pid)."""
    st = proc_stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"
