"""Small helpers shared across modules."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path


class RunError(RuntimeError):
    """A run stopped by a failure under it (a worker died, a checkpoint could not be written, a weight sync
    failed on a rank); its last complete checkpoint is intact and the same command resumes from it."""


class OccupiedFolder(FileExistsError):
    """An output folder that holds something megareason did not write there: it is never replaced."""


@dataclass(frozen=True)
class OutputKind:
    """A kind of folder megareason writes, told apart by the names of its entries (top level). Writing one
    may replace an earlier folder of the same kind, never a folder holding anything else."""

    what: str  # for messages, after "an earlier": e.g. "HF model folder"
    marks: tuple[str, ...]  # name patterns (fnmatch) each matched by some entry of every such folder
    entries: tuple[str, ...]  # name patterns that match every entry such a folder may hold

    def strangers(self, folder: Path) -> list[str]:
        """The entries of ``folder`` that this kind never writes, sorted; all of them when a mark is
        missing (the folder is not one of these)."""
        names = sorted(p.name for p in folder.iterdir())
        if names and not all(any(fnmatchcase(n, m) for n in names) for m in self.marks):
            return names
        return [n for n in names if not any(fnmatchcase(n, e) for e in self.entries)]


def check_replaceable(target: Path, kind: OutputKind) -> None:
    """Writing a folder of ``kind`` at ``target`` loses nothing of anyone else's: ``target`` does not exist,
    is an empty folder or an earlier folder of ``kind``. ``OccupiedFolder`` otherwise, naming a few of
    the entries that would be lost."""
    target = Path(target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        what = "a symbolic link" if target.is_symlink() else "not a folder"
        raise OccupiedFolder(f"output folder {target} is {what}; name a new or empty folder (or an earlier "
                             f"{kind.what}) instead")
    if not target.exists():
        return
    strangers = kind.strangers(target)
    if strangers:
        shown = ", ".join(strangers[:5]) + (f" and {len(strangers) - 5} more" if len(strangers) > 5 else "")
        raise OccupiedFolder(f"output folder {target} is neither empty nor an earlier {kind.what} (it holds "
                             f"{shown}); megareason replaces only its own output there: name a new or empty "
                             "folder, or move those away first")


def replace_directory(tmp: Path, target: Path, kind: OutputKind) -> None:
    """Move the finished directory ``tmp`` to ``target`` by renames, replacing an older ``target`` only
    once the new one is complete (a crash leaves the old or the new one, never a mix), and only when the
    older one is an earlier folder of ``kind`` or empty (``check_replaceable``; ``OccupiedFolder``)."""
    check_replaceable(target, kind)
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)


@contextmanager
def atomic_directory(target: str | Path, kind: OutputKind) -> Iterator[Path]:
    """Write a directory atomically: fill the yielded temporary directory (beside ``target``, so the
    final rename stays on one file system); on success it becomes ``target`` (``replace_directory``: an
    existing ``target`` must be empty or an earlier folder of ``kind``, checked before and after the
    writing), on error it is removed."""
    target = Path(target)
    check_replaceable(target, kind)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        replace_directory(tmp, target, kind)
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


def is_hub_id(name: str) -> bool:
    """``name`` is spelled as a Hugging Face Hub repository (``org/name``) and no such local path exists."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") != 1 or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


# Processes by (pid, start time), through psutil: launch/reaper.py, rollout/engine.py.


def proc_stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, psutil status, start time) of ``pid``, or None if it is gone."""
    import psutil

    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return p.ppid(), p.status(), p.create_time()
    except psutil.Error:
        return None


def process_table() -> dict[int, tuple[int, str, float]]:
    """Every process: pid -> (parent pid, psutil status, start time)."""
    import psutil

    out = {}
    for p in psutil.process_iter(["ppid", "status", "create_time"]):
        info = p.info
        if info["create_time"] is not None and info["ppid"] is not None:
            out[p.pid] = (info["ppid"], info["status"], info["create_time"])
    return out


def descendants(roots: set[int], table: dict[int, tuple[int, str, float]]) -> dict[int, float]:
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


def alive(pid: int, start: float) -> bool:
    """``pid`` still runs the process that started at ``start`` (not a zombie, not a recycled pid)."""
    import psutil

    st = proc_stat(pid)
    return st is not None and st[2] == start and st[1] != psutil.STATUS_ZOMBIE


def process_name(pid: int) -> str:
    """The process's name (Linux: its ``comm``, 15 characters at most), or "" if it is gone."""
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""
