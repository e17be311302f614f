"""One writer per run folder: a second ``train`` on a busy ``trainer.output_dir`` stops at once naming the
holder, writes nothing there, and a holder that died (even by SIGKILL) never blocks the next run — also where
the file system has no flock, and after a node crash, for the requeue of the same Slurm job."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import re
import socket
import subprocess
import sys

import pytest

from megareason.trainer import run_dir, run_lock
from megareason.trainer.run_dir import RunFolderBusy, hold_run_lock

_HOLD = ("import sys, time\nfrom megareason.trainer.run_dir import hold_run_lock\n"
         "hold_run_lock(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)\n")


def test_a_second_writer_is_refused_and_a_killed_holder_never_blocks(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid} on {socket.gethostname()}"):
            hold_run_lock(run)
        # The CLI: one line naming the holder, exit 2, and nothing written into the busy folder.
        proc = subprocess.run([sys.executable, "-m", "megareason.cli", "train", "--config-name", "grpo_smollm2_cpu",
                               f"trainer.output_dir={run}"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"error: {run.resolve()} is in use by another run (pid {holder.pid}" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert [p.name for p in run.iterdir()] == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    hold_run_lock(run)  # the SIGKILLed holder's lock went with it
    hold_run_lock(run)  # taken again by its holder: a no-op
    assert (run / ".lock").read_text().startswith(f"pid {os.getpid()} on {socket.gethostname()}")


# ------------------------------------------------------------------------ where flock does not work
# Lustre mounted noflock, NFS without a lock manager: flock fails with ENOLCK / EOPNOTSUPP, made to here by
# replacing fcntl.flock. The lock is then the exclusive-create file .lock.held, naming its holder.

_NO_FLOCK = ("import errno, fcntl, sys, time\n"
             "def no_flock(fd, op): raise OSError(errno.ENOLCK, 'No locks available')\n"
             "fcntl.flock = no_flock\n"
             "from megareason.trainer.run_dir import hold_run_lock\n"
             "hold_run_lock(sys.argv[1])\nprint('held', flush=True)\n"
             "if sys.argv[2] == 'wait': time.sleep(600)\n")


def _no_flock(monkeypatch, err: int = errno.ENOLCK) -> None:
    def flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(run_dir, "_LOCKS", {})


def _holder(**changes) -> run_lock.Holder:
    base = run_lock.Holder(pid=4242, host="gpu-031", job="7001", restart=0, started=1.0e9, since="2026-11-28 03:00:00")
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_without_flock_an_exclusive_file_names_the_holder_and_a_killed_one_never_blocks(tmp_path, monkeypatch, err):
    _no_flock(monkeypatch, err)
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _NO_FLOCK, str(run), "wait"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        held = (run / ".lock.held").read_text()
        assert held.startswith(f"pid {holder.pid} on {socket.gethostname()}, since ")
        with pytest.raises(RunFolderBusy, match=rf"in use by another run \(pid {holder.pid} on .*its lock {run}/"
                                                rf"\.lock\.held, kept where flock does not work"):
            hold_run_lock(run)
        assert (run / ".lock.held").read_text() == held  # the refused run left it alone
    finally:
        holder.kill()
        holder.wait()
    hold_run_lock(run)  # the SIGKILLed holder's file is still there: its PID is gone from this host
    assert run_lock.parse((run / ".lock.held").read_text()).pid == os.getpid()
    hold_run_lock(run)  # again in its holder: a no-op


def test_without_flock_a_holder_that_ends_normally_removes_its_file(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _NO_FLOCK, str(run), "exit"], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "held", proc.stderr
    assert not (run / ".lock.held").exists() and (run / ".lock").exists()


@pytest.mark.parametrize("holder, squeue, taken", [
    # the requeue of the same job, on other nodes: the crashed node's lock never blocks it
    (_holder(job="7001", restart=0), None, "it was this Slurm job's run before its requeue (restart 0; this is "
                                          "restart 1)"),
    (_holder(job="7001", restart=1), None, None),  # the same run of the same job on another node: live
    (_holder(job="6990"), "RUNNING", None),
    (_holder(job="6990"), "PENDING", None),  # requeued, waiting to come back
    (_holder(job="6990"), "", "Slurm job 6990 is no longer running (squeue lists none)"),
    (_holder(job="6990"), "NODE_FAIL", "Slurm job 6990 is NODE_FAIL"),
    (_holder(job="6990"), None, None),  # squeue cannot be asked: not provably gone
    (_holder(job=None), None, None),  # another host outside Slurm: cannot be checked
    (_holder(host=socket.gethostname(), pid=os.getpid(), job=None, started=1.0e9), None,
     f"pid {os.getpid()} on {socket.gethostname()} is another process now (started later)"),  # a reused PID
], ids=["earlier-restart", "same-restart", "running", "pending", "gone", "node-fail", "no-squeue", "other-host",
        "reused-pid"])  # fixed ids: xdist's workers must collect the same names, and the last case holds a PID
def test_a_stale_holder_is_taken_over_naming_why_and_a_live_one_refused(tmp_path, monkeypatch, capsys, holder,
                                                                        squeue, taken):
    _no_flock(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock.held").write_text(holder.text())
    env = {"SLURM_JOB_ID": "7001", "SLURM_RESTART_COUNT": "1"}
    asked = []

    def state(job):
        asked.append(job)
        return squeue

    if taken is None:
        with pytest.raises(RunFolderBusy, match=re.escape(f"({holder.shown}; its lock {run}/.lock.held")):
            run_lock.take(run, env, state)
        assert (run / ".lock.held").read_text() == holder.text()
    else:
        run_lock.take(run, env, state)
        now = run_lock.parse((run / ".lock.held").read_text())
        assert (now.pid, now.job, now.restart) == (os.getpid(), "7001", 1)
        assert f"named {holder.shown}, gone: {taken}; removed" in capsys.readouterr().err
    assert asked == ([holder.job] if holder.job not in (None, "7001") and holder.host != socket.gethostname() else [])


def test_a_flock_held_for_a_crashed_node_does_not_block_the_requeue_of_its_job(tmp_path, monkeypatch, capsys):
    """The file server keeps a dead client's flock until it expires: the requeue of the same job takes the
    folder with .lock.held; a job that is not the holder's is refused."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text(_holder(job="7001", restart=0).text())

    def held_elsewhere(fd, op):
        raise BlockingIOError(errno.EWOULDBLOCK, "Resource temporarily unavailable")

    monkeypatch.setattr(fcntl, "flock", held_elsewhere)
    with pytest.raises(RunFolderBusy, match=r"in use by another run \(pid 4242 on gpu-031, Slurm job 7001 \(restart "
                                            r"0\), since 2026-11-28 03:00:00\)"):
        run_lock.take(run, {"SLURM_JOB_ID": "7002"}, lambda job: "RUNNING")
    assert not (run / ".lock.held").exists()
    run_lock.take(run, {"SLURM_JOB_ID": "7001", "SLURM_RESTART_COUNT": "1"}, lambda job: "RUNNING")
    assert "is held by pid 4242 on gpu-031" in capsys.readouterr().err
    assert run_lock.parse((run / ".lock.held").read_text()).pid == os.getpid()
    assert run_lock.parse((run / ".lock").read_text()).pid == os.getpid()


def test_squeue_answers_for_a_job(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text('#!/bin/sh\ncase "$*" in\n  *" 11 "*) echo RUNNING;;\n'
                                 '  *" 12 "*) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;\n'
                                 '  *) echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1;;\n'
                                 'esac\n')
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    assert [run_lock.squeue_state(j) for j in ("11", "12", "13")] == ["RUNNING", "", None]
