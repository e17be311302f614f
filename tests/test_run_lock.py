"""One writer per run folder: a second ``train`` on a busy ``trainer.output_dir`` stops at once naming the
holder, writes nothing there, and a holder that died (even by SIGKILL) never blocks the next run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

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
