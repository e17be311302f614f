"""Quiet by default: what a run shows on the console, and the log files that keep everything else.

The console shows megareason's own log lines (the driver's and, through Ray, the workers'), the progress
bar, the metrics and errors. What the rest of the stack prints — vLLM's and Ray's start-up lines,
megatron-core's TransformerEngine/Apex fallbacks, deprecation and future warnings, vLLM's "Failed to
load weights" after every weight sync — goes to the run folder's ``logs/``:

* ``logs/driver.log`` (``logs/benchmark.log``; ``megareason eval``: ``eval.log`` in its results folder):
  the driver's log records at INFO and above, Python warnings, and whatever it and its child processes
  write to stdout/stderr (``megareason eval`` runs vLLM's engine in the driver: its output lands there);
* ``logs/<role>_rank<R>.log`` (``policy_rank0.log``, ``critic_rank0.log``): each Ray worker's, with the
  vLLM engine processes it starts. Files are appended to: a resumed run continues them.

How: a process points its file descriptors 1 and 2 at its log file (``os.dup2``: child processes and
C-level writes follow) and keeps duplicates of the originals for the console. In the driver,
``sys.stdout``/``sys.stderr`` become those console duplicates (prints, tqdm, Ray's forwarding of worker
lines), except for what other libraries' own log handlers write there (``_Console``); the records
that reach the root logger, and Python warnings, go to the file, only megareason's records and errors
to the console too. In a Ray worker (``setup_worker``, Ray's worker setup hook) ``sys.stdout`` and
``sys.stderr`` stay on the file, and megareason's records (and anyone's errors) also go to the worker's
original stderr, which Ray forwards to the driver's console, prefixed ``(policy rank 0)``.

``megareason -v`` or ``MEGAREASON_VERBOSE=1``: nothing is redirected, everything reaches the console.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VERBOSE_ENV = "MEGAREASON_VERBOSE"  # set (not "0"): everything on the console, as the libraries print it
LOG_DIR_ENV = "MEGAREASON_LOG_DIR"  # the logs/ folder of the driver's run, for its workers
# A runtime_env's setup hook replaces the one a node's raylet passes on to its workers
# (launch/ray_node.py's start_shielded sets both): ``setup_worker`` runs that one first.
NODE_HOOK_ENV = "MEGAREASON_NODE_SETUP_HOOK"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATEFMT = "%H:%M:%S"

_console: logging.Handler | None = None  # this process's handler that writes to the console
_log_dir: Path | None = None  # the driver's logs folder while ``captured``
_last_log: Path | None = None  # the driver's log file of the latest ``captured`` run
_worker_log: Path | None = None  # a worker's own log file
_prefix = ""  # a worker's console prefix, "(policy rank 0) "


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def last_log() -> Path | None:
    """The log file of the driver's latest ``captured`` run (None: nothing was captured)."""
    return _last_log


class _Own(logging.Filter):
    """megareason's records, and anyone's errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".")[0] == "megareason"


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _prefix + super().format(record)


def setup_console(verbose_flag: bool) -> None:
    """The driver's logging, first thing in the CLI: records at INFO (DEBUG with ``-v``) on stderr, every
    library's, as ``logging.basicConfig`` (and like it, nothing changes in a process whose logging is set
    up already, such as pytest's). ``captured`` narrows the console down for the length of a run."""
    global _console
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
    root = logging.getLogger()
    if root.handlers:
        return
    root.setLevel(logging.DEBUG if verbose() else logging.INFO)
    _console = logging.StreamHandler(sys.stderr)
    _console.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    root.addHandler(_console)


@contextmanager
def captured(path: Path) -> Iterator[Path | None]:
    """Driver, for the length of a run: only megareason's lines, the progress bar, prints and errors reach
    the console; the rest goes to ``path`` (appended to), and the Ray workers started inside write to its
    folder (``worker_runtime_env``). Yields ``path``, or None when verbose (nothing changes). A log that
    received nothing but its header line is removed at the end (a config refused before anything ran)."""
    global _log_dir, _last_log
    if verbose() or _log_dir is not None:
        yield None
        return
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = not path.exists()
    saved = sys.stdout, sys.stderr
    out_fd, err_fd, header = _redirect(path)
    sys.stdout = _console_stream(saved[0], out_fd)
    sys.stderr = _console_stream(saved[1], err_fd)
    _log_dir, _last_log = path.parent, path
    root, own = logging.getLogger(), _Own()
    to_file = logging.StreamHandler(sys.__stderr__)  # descriptor 2: the log file
    to_file.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    root.addHandler(to_file)
    if _console is not None:
        _console.setStream(sys.stderr)
        _console.addFilter(own)
    logging.captureWarnings(True)  # Python warnings become records of "py.warnings": the file only
    # Ray prints forwarded worker lines as "(PolicyWorker pid=N) ..."; the workers prefix their own.
    prefix_env = "RAY_DISABLE_WORKER_LOG_PREFIX" in os.environ
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    try:
        yield path
    except Exception:
        traceback.print_exc(file=sys.__stderr__)  # the console gets it from the caller
        raise
    finally:
        logging.captureWarnings(False)
        root.removeHandler(to_file)
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            stream.flush()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        console = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = saved[0], saved[1]
        if _console is not None:
            _console.setStream(sys.stderr)
            _console.removeFilter(own)
        for stream, old in zip(console, saved, strict=True):
            if stream is not old:
                stream.close()  # its descriptor: a duplicate made by _console_stream
        os.close(out_fd)
        os.close(err_fd)
        if not prefix_env:
            os.environ.pop("RAY_DISABLE_WORKER_LOG_PREFIX", None)
        _log_dir = None
        if fresh and path.stat().st_size == header:
            path.unlink()
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # if empty


def worker_runtime_env(env_vars: dict[str, str]) -> dict:
    """Ray's ``runtime_env`` for the workers: ``env_vars``, plus the driver's logs/ folder and the setup
    hook (``setup_worker``) that sends each worker's output there when the driver logs to a folder."""
    if _log_dir is None:
        return {"env_vars": env_vars}
    return {"env_vars": {**env_vars, LOG_DIR_ENV: str(_log_dir)},
            "worker_process_setup_hook": f"{__name__}.setup_worker"}


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: this worker's output goes to ``$MEGAREASON_LOG_DIR/worker_<pid>.log``
    (renamed by ``name_worker``); megareason's records and errors also go to the original stderr, which Ray
    forwards to the driver's console. Runs before the worker imports anything else of megareason."""
    global _console, _worker_log, _prefix
    if os.environ.get(NODE_HOOK_ENV):
        module, name = os.environ[NODE_HOOK_ENV].rsplit(".", 1)
        getattr(importlib.import_module(module), name)()
    logs = os.environ.get(LOG_DIR_ENV)
    if verbose() or not logs:
        return
    path = Path(logs) / f"worker_{os.getpid()}.log"
    try:  # a node that cannot write the run folder keeps its output on the console
        path.parent.mkdir(parents=True, exist_ok=True)
        out_fd, err_fd, _ = _redirect(path)
    except OSError as e:
        print(f"megareason: cannot write {path} ({e}); this worker's output stays on the console", file=sys.stderr)
        return
    os.close(out_fd)  # Ray forwards the worker's stderr and stdout alike: one is enough
    _worker_log, _prefix = path, f"(worker pid {os.getpid()}) "
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    to_file = logging.StreamHandler(sys.stderr)  # descriptor 2: the log file
    to_file.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    _console = logging.StreamHandler(os.fdopen(err_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace"))
    _console.setFormatter(_Prefixed(_FORMAT, _DATEFMT))
    _console.addFilter(_Own())
    root.addHandler(to_file)
    root.addHandler(_console)
    logging.captureWarnings(True)


def last_worker_error(role: str, rank: int, tail_bytes: int = 65536) -> str | None:
    """The message of the last ERROR record in ``logs/<role>_rank<R>.log`` (its last ``tail_bytes``), or None:
    why a worker that exited by itself died. The worker writes it to its file before exiting, so unlike
    Ray's forwarding of its console lines it is there when the driver learns of the death."""
    if _log_dir is None:
        return None
    path = _log_dir / f"{role}_rank{rank}.log"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    errors = [line.split(": ", 1)[-1] for line in lines if " ERROR " in line]
    return errors[-1] if errors else None


def name_worker(role: str, rank: int) -> None:
    """A worker that knows its role and rank: its console lines read ``(role rank R) ...`` and its log
    becomes ``<role>_rank<R>.log`` (appended to across restarts). A no-op without ``setup_worker``."""
    global _worker_log, _prefix
    if _worker_log is None:
        return
    _prefix = f"({role} rank {rank}) "
    target = _worker_log.with_name(f"{role}_rank{rank}.log")
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, _worker_log.read_bytes())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _worker_log.unlink()
    _worker_log = target


def _redirect(path: Path) -> tuple[int, int, int]:
    """Point descriptors 1 and 2 at ``path`` (appended to, after a header line); returns duplicates of the
    previous ones (stdout, stderr) and the file's size after the header."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {' '.join(sys.argv)}\n".encode())
    size = os.fstat(fd).st_size
    out, err = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return out, err, size


def _console_stream(stream, fd: int):
    """The console for ``sys.stdout``/``sys.stderr`` during a run: a ``_Console`` on a duplicate of ``fd``,
    or ``stream`` itself when it does not write to descriptor 1 or 2 (pytest's capsys)."""
    try:
        on_fd = stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):
        on_fd = False
    if not on_fd:
        return stream
    return _Console(os.fdopen(os.dup(fd), "wb"), encoding="utf-8", errors="backslashreplace", line_buffering=True)


_EMIT = logging.StreamHandler.emit.__code__


class _Console(io.TextIOWrapper):
    """The driver's console while it runs: prints, progress bars, Ray's forwarding of the workers' lines and
    megareason's log handler write here. Other libraries' own log handlers hold ``sys.stderr`` too (Ray's
    looks it up at each record, transformers' when it is first used), and would reach the console with
    their start-up lines: what such a handler writes goes to the log file instead, errors excepted."""

    def write(self, text: str) -> int:
        caller = sys._getframe(1)
        if caller.f_code is _EMIT:  # logging.StreamHandler.emit: self is the handler, record the record
            handler, record = caller.f_locals.get("self"), caller.f_locals.get("record")
            if handler is not _console and getattr(record, "levelno", 0) < logging.ERROR:
                return sys.__stderr__.write(text)
        return super().write(text)
