"""Quiet by default (megareason/logs.py): in a driver's run and in a worker, megareason's lines and errors
reach the console while third-party records, Python warnings, C-level writes and child processes' output
go to the log file; ``MEGAREASON_VERBOSE`` (or ``-v``, before or after the command) leaves everything on
the console. Each run case runs in a fresh Python process, whose descriptors 1 and 2 are the pipes read
here; the command line's flag is read in this one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NOISE = """
import logging, os, subprocess, sys, warnings
logging.getLogger("megareason.trainer").info("own line")
logging.getLogger("vllm.layerwise").warning("RotaryEmbedding: Failed to load weights")
logging.getLogger("vllm.engine").error("a third-party error")
warnings.warn("Apex is not installed", UserWarning)
os.write(2, b"C-level noise\\n")
subprocess.run([sys.executable, "-c", "import sys; print('child stdout'); print('child stderr', file=sys.stderr)"])
print("printed line", flush=True)
lib = logging.getLogger("somelib")  # a library with a handler of its own, as Ray's and transformers' loggers
lib.addHandler(logging.StreamHandler(sys.stderr))
lib.propagate = False
lib.warning("library start-up line")
"""


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, check=True)


def _in_run(log: Path, after: str = "") -> str:
    """A driver script: NOISE inside ``captured(log)``, then ``after``."""
    return (f"from megareason import logs\nlogs.setup_console(False)\nwith logs.captured({str(log)!r}) as path:\n"
            f"    print('captured:', path is not None, flush=True)\n{textwrap.indent(NOISE, '    ')}\n{after}")


def test_a_driver_run_keeps_third_party_output_in_its_log(tmp_path):
    log = tmp_path / "run" / "logs" / "driver.log"
    proc = _run(_in_run(log, "print('after the run', flush=True)\nwarnings.warn('after', UserWarning)\n"))
    assert "captured: True" in proc.stdout
    console = proc.stdout + proc.stderr
    assert "INFO megareason.trainer: own line" in console and "a third-party error" in console
    assert "printed line" in proc.stdout and "after the run" in proc.stdout
    for noise in ("Failed to load weights", "Apex is not installed", "C-level noise", "child stdout", "child stderr",
                  "library start-up line"):
        assert noise not in console, noise
    text = log.read_text()
    for line in ("own line", "Failed to load weights", "a third-party error", "UserWarning: Apex is not installed",
                 "C-level noise", "child stdout", "child stderr", "library start-up line"):
        assert line in text, line
    assert "printed line" not in text and "after" not in text.split("child stderr")[1]
    assert "UserWarning: after" in proc.stderr  # the run is over: warnings print as usual again


def test_a_failing_run_leaves_its_traceback_in_the_log_and_an_empty_one_leaves_nothing(tmp_path):
    log = tmp_path / "logs" / "driver.log"
    script = f"from megareason import logs\nwith logs.captured({str(log)!r}):\n    raise RuntimeError('boom')\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    assert "RuntimeError: boom" in log.read_text()
    quiet = tmp_path / "quiet" / "logs" / "driver.log"
    _run(f"from megareason import logs\nwith logs.captured({str(quiet)!r}):\n    pass\n")
    assert not quiet.parent.exists()


def test_verbose_leaves_everything_on_the_console(tmp_path):
    log = tmp_path / "logs" / "driver.log"
    proc = _run(_in_run(log), MEGAREASON_VERBOSE="1")
    assert "captured: False" in proc.stdout
    assert "Failed to load weights" in proc.stderr and "C-level noise" in proc.stderr and not log.exists()


def test_a_worker_logs_to_its_rank_file_and_shows_its_own_lines_prefixed(tmp_path):
    hook = tmp_path / "node_hook.py"
    hook.write_text("def run():\n    print('node hook ran', flush=True)\n")
    worker = ("from megareason import logs\nlogs.setup_worker()\nimport warnings\n"
              "warnings.warn('Transformer Engine and Apex are not installed', UserWarning)\n"
              "logs.name_worker('policy', 1)\n" + NOISE)
    proc = _run(worker, MEGAREASON_LOG_DIR=str(tmp_path / "logs"), MEGAREASON_NODE_SETUP_HOOK="node_hook.run",
                PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert "node hook ran" in proc.stdout  # the node's own setup hook ran first, before the redirect
    assert "(policy rank 1) " in proc.stderr and "INFO megareason.trainer: own line" in proc.stderr
    assert "a third-party error" in proc.stderr
    for noise in ("Failed to load weights", "not installed", "C-level noise", "child stdout", "printed line"):
        assert noise not in proc.stdout + proc.stderr, noise
    (log,) = Path(tmp_path / "logs").iterdir()
    assert log.name == "policy_rank1.log"
    text = log.read_text()
    for line in ("Transformer Engine and Apex are not installed", "own line", "Failed to load weights",
                 "C-level noise", "child stdout", "child stderr", "printed line"):
        assert line in text, line


def test_workers_get_the_log_folder_and_their_setup_hook_only_during_a_run(tmp_path):
    from megareason import logs

    assert logs.worker_runtime_env({"A": "1"}) == {"env_vars": {"A": "1"}}
    with logs.captured(tmp_path / "logs" / "driver.log") as path:
        env = logs.worker_runtime_env({"A": "1"})
    assert env == {"env_vars": {"A": "1", "MEGAREASON_LOG_DIR": str(tmp_path / "logs")},
                   "worker_process_setup_hook": "megareason.logs.setup_worker"}
    assert path == tmp_path / "logs" / "driver.log" and logs.last_log() == path
    assert logs.worker_runtime_env({}) == {"env_vars": {}}


def test_the_last_error_of_a_dead_worker_is_read_from_its_log(tmp_path, monkeypatch):
    """The driver names why a worker died from the worker's own file (written before it exited), not from
    Ray's asynchronous forwarding of its console."""
    from megareason import logs

    monkeypatch.setattr(logs, "_log_dir", tmp_path)
    assert logs.last_worker_error("policy", 0) is None  # no file yet
    (tmp_path / "policy_rank0.log").write_text(
        "14:08:01 INFO megareason.trainer: step 1\n"
        "14:08:02 ERROR megareason.rollout: an older error\n"
        "(EngineCore pid=7) INFO 11-25 14:08:03 [core.py:1] something\n"
        "14:08:04 ERROR megareason.rollout.engine: the vLLM engine core process (pid 42) of this worker "
        "(pid 7) is gone\n")
    assert logs.last_worker_error("policy", 0) == "the vLLM engine core process (pid 42) of this worker (pid 7) is gone"
    assert logs.last_worker_error("policy", 1) is None
    monkeypatch.setattr(logs, "_log_dir", None)  # no run folder: nothing to read
    assert logs.last_worker_error("policy", 0) is None


@pytest.mark.parametrize("argv", [["-v", "train", "--show-config"], ["train", "-v", "--show-config"],
                                  ["train", "--show-config", "--verbose", "trainer.steps=3"],
                                  ["sft", "trainer.steps=3", "-v", "--show-config"]])
def test_verbose_goes_before_or_after_the_command(argv, monkeypatch, capsys):
    from megareason import logs
    from megareason.cli import main
    from megareason.launch import reaper

    monkeypatch.setattr(reaper, "reap_descendants_on_exit", lambda: None)
    monkeypatch.setenv(logs.VERBOSE_ENV, "0")
    assert main(argv) == 0
    assert logs.verbose() and '"steps":' in capsys.readouterr().out


def test_without_verbose_a_command_stays_quiet(monkeypatch):
    from megareason import logs
    from megareason.cli import main
    from megareason.launch import reaper

    monkeypatch.setattr(reaper, "reap_descendants_on_exit", lambda: None)
    monkeypatch.setenv(logs.VERBOSE_ENV, "0")
    assert main(["train", "--show-config"]) == 0
    assert not logs.verbose()
