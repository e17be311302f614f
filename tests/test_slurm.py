"""The sbatch recipes for real, on a Slurm controller and two ``slurmd`` "nodes" on this machine
(``tests/slurm_cluster.py``, one cluster per session), plus the parts of the job that run without it.

Here: a broken override refused before Ray starts and ``sbatch --test-only`` of the recipe's directives. The
recipe's job end to end on both nodes, interrupted by SIGUSR1 and by a pre-emption's SIGTERM, requeued and
resumed to its golden curve, is test_nemo_run.py's (NeMo-Run submits the same job body this script runs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
from slurm_cluster import REPO, read_log, tiny_raro

from megareason.config import load_config
from megareason.launch import nemo_run, ray_node
from megareason.launch.plan import PlanOptions, plan_config
from megareason.launch.preemption import LeadOptions, checkpoint_bytes, plan_lead, preemption_lead
from megareason.trainer.driver import EXIT_STOPPED, checkpoint_due, stop_signals

# ----------------------------------------------------------------------------------------- no cluster


def test_a_signal_asks_the_loop_to_stop_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    with stop_signals() as stop:
        assert stop.signal is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signal == signal.SIGUSR1
        # the job script's SIGUSR1 first, then a pre-emption's SIGTERM: still handled (not a kill)
        assert signal.getsignal(signal.SIGTERM) is stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGUSR1
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second SIGTERM kills as usual
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
    with stop_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGTERM
    assert EXIT_STOPPED == 75  # slurm/ray_cluster.sh relies on it


def test_a_checkpoint_is_due_every_n_steps_every_m_minutes_and_at_the_end():
    cfg = load_config("raro_smollm2_cpu", ["trainer.steps=10", "trainer.save_every=4",
                                           "trainer.save_every_minutes=30"])
    assert [s for s in range(1, 11) if checkpoint_due(cfg, s, 0.0)] == [4, 8, 10]
    assert checkpoint_due(cfg, 3, 30 * 60) and not checkpoint_due(cfg, 3, 30 * 60 - 1)
    off = load_config("raro_smollm2_cpu", ["trainer.steps=10", "trainer.save_every=0"])
    assert [s for s in range(1, 11) if checkpoint_due(off, s, 1e9)] == [10]  # minutes off by default
    proc = subprocess.run([sys.executable, "-m", "megareason.cli", "train", "--show-config",
                           "trainer.save_every_minutes=-1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "trainer.save_every_minutes" in proc.stderr


def test_the_preemption_lead_covers_a_step_and_a_checkpoint_and_the_70b_recipe_asks_for_it():
    # 70B, bf16: 2 bytes of weights + 12 of fp32 main weights and Adam moments per parameter
    cfg = load_config("raro_70b", [])
    assert checkpoint_bytes(cfg, 70_000_000_000, 70_000_000_000) == 70e9 * 14
    # 32 trainer ranks, 8 per node, each writing 1/32 of 8 TB: 2 TB per node at 2 GB/s
    lead = preemption_lead(1000.0, 8e12, ranks=32, ranks_per_node=8, options=LeadOptions(write_gb_s_per_node=2.0))
    assert (lead.nodes, lead.bytes_per_node, lead.checkpoint_s) == (4, 2e12, 1000.0)
    assert lead.seconds == 60 * -(-(2000 * 1.25 + 120) // 60) == 2640  # whole minutes, rounded up
    assert lead.line() == ("pre-emption lead: a step 1000 s + a checkpoint of 8000 GB written by 4 nodes, 2000 GB per "
                           "node at 2 GB/s = 1000 s, x 1.25 + 120 s teardown = #SBATCH --signal=B:USR1@2640")
    # 12 trainer ranks beside separate engines on 2 nodes of 8: the first node writes 8/12 of it
    assert preemption_lead(0.0, 6e12, ranks=12, ranks_per_node=8).bytes_per_node == 4e12
    assert preemption_lead(0.0, 6e12, ranks=4, ranks_per_node=8).bytes_per_node == 6e12  # all on one node
    plan = plan_config("raro_70b", [], PlanOptions(nodes=8, gpus_per_node=8), "llama-3.1-70b")
    need = plan_lead(plan, cfg)
    assert need.step_s == pytest.approx(sum(plan.seconds.values()))
    # 70,553,706,496 parameters x 14 bytes = 987.75 GB; TP 8 x PP 4 x DP 2 fill the 8 nodes: 123.47 GB per
    # node, 61.7 s at 2 GB/s
    assert plan.total_params == 70_553_706_496 and need.checkpoint_bytes == 70_553_706_496 * 14
    assert need.nodes == 8 and need.bytes_per_node == pytest.approx(123.47e9, rel=1e-4)
    assert need.checkpoint_s == pytest.approx(61.73, abs=0.01)
    assert "written by 8 nodes, 123 GB per node at 2 GB/s = 62 s" in need.line()
    directives = nemo_run.sbatch_directives(REPO / "slurm" / "raro_70b.sbatch")
    granted = int(re.fullmatch(r"B:USR1@(\d+)", directives["signal"]).group(1))
    assert granted >= need.seconds, f"slurm/raro_70b.sbatch's --signal lead {granted} s < {need.line()}"
    assert directives["mem"] == "0" and directives["exclusive"] is True and directives["requeue"] is True
    out = subprocess.run([sys.executable, "-m", "megareason.cli", "plan", "--model-shape", "llama-3.1-70b",
                          "--nodes", "8", "configs/raro_70b.yaml"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"--signal=B:USR1@{need.seconds}" in out.stdout


# A stand-in for `ray start --block`: a child and a grandchild (like the GCS and a raylet's worker), a
# session log, and its PIDs in a file; it runs until killed.
FAKE_RAY = """\
import os, subprocess, sys, time
from pathlib import Path
temp = Path(sys.argv[1])
(temp / "session_1" / "logs").mkdir(parents=True)
(temp / "session_1" / "logs" / "raylet.out").write_text("raylet log")
(temp / "session_latest").symlink_to(temp / "session_1")
child = subprocess.Popen([sys.executable, "-c",
                          "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                          "'import time; time.sleep(600)']); time.sleep(600)"])
time.sleep(1)
(temp.parent / "pids").write_text(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_ray_node_outlives_sigterm_then_stops_on_the_stop_file_and_keeps_its_logs(tmp_path):
    job_dir, temp, run = tmp_path / "job", tmp_path / "node" / "mr-ray-7-0", tmp_path / "run"
    job_dir.mkdir()
    temp.mkdir(parents=True)
    (job_dir / ray_node.RUN_DIR_FILE).write_text(f"{run}\n")
    (tmp_path / "fake_ray.py").write_text(FAKE_RAY)
    script = (f"import sys; from pathlib import Path; from megareason.launch import ray_node; "
              f"sys.exit(ray_node.run([sys.executable, {str(tmp_path / 'fake_ray.py')!r}, {str(temp)!r}], "
              f"Path({str(job_dir)!r}), Path({str(temp)!r}), 0, 0.1))")
    env = {**os.environ, "SLURMD_NODENAME": "n7", "SLURM_RESTART_COUNT": "3"}
    sup = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "node" / "pids").exists():
            assert sup.poll() is None and time.time() < deadline
            time.sleep(0.2)
        time.sleep(0.5)
        tree = ray_node.process_tree(sup.pid)
        assert len(tree) == 4, tree  # supervisor, fake ray, its child, the grandchild
        for pid in tree:  # what slurmstepd does on `scancel --signal=TERM`: every process of the step
            os.kill(pid, signal.SIGTERM)
        time.sleep(2)
        assert all(_alive(p) for p in tree), "SIGTERM must not end the Ray node"
        (job_dir / ray_node.STOP_FILE).touch()
        assert sup.wait(timeout=60) == 0
        out = sup.stdout.read()
    finally:
        if sup.poll() is None:
            sup.kill()
    assert "SIGTERM (a pre-emption or scancel): Ray keeps running" in out
    deadline = time.time() + 10
    while any(_alive(p) for p in tree[1:]) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in tree[1:]), "the whole process tree is killed"
    kept = run / "ray_logs" / "restart_3" / "n7" / "raylet.out"
    assert kept.read_text() == "raylet log" and f"its logs are in {kept.parent}" in out
    assert not temp.exists(), "the node-local temp dir is removed"


def test_ray_start_is_retried_until_the_cluster_is_up(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    attempts = tmp_path / "attempts"
    failing = [sys.executable, "-c", f"open({str(attempts)!r}, 'a').write('x'); raise SystemExit(3)"]
    assert ray_node.run(failing, job_dir, tmp_path / "t", retries=2, retry_delay=0.1) == 3
    assert attempts.read_text() == "xxx"  # once + 2 retries
    (job_dir / ray_node.UP_FILE).touch()  # once the cluster is up, a Ray node that dies ends the step
    attempts.unlink()
    assert ray_node.run(failing, job_dir, tmp_path / "t", retries=2, retry_delay=0.1) == 3
    assert attempts.read_text() == "x"


SHIELDED_WORKER = """\
import multiprocessing as mp, os, signal, sys, time
from pathlib import Path

def blocked(pid):  # SIGTERM in every thread's blocked mask
    masks = [int(line.split()[1], 16) for t in Path(f"/proc/{pid}/task").iterdir()
             for line in (t / "status").read_text().splitlines() if line.startswith("SigBlk:")]
    return all(m & (1 << (signal.SIGTERM - 1)) for m in masks)

if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as inherited from the raylet
    if sys.argv[1] == "shield":
        from megareason.launch.ray_node import shield_worker
        shield_worker()
    child = mp.get_context("spawn").Process(target=time.sleep, args=(60,))  # what vLLM's engines do
    child.start()
    time.sleep(1)
    print(blocked(os.getpid()), blocked(child.pid), flush=True)
    os.kill(child.pid, signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)
    print("alive", child.is_alive(), flush=True)
    child.kill()
"""


def test_python_multiprocessing_unblocks_sigterm_and_the_worker_hook_blocks_it_for_good(tmp_path):
    (tmp_path / "w.py").write_text(SHIELDED_WORKER)
    plain = subprocess.run([sys.executable, str(tmp_path / "w.py"), "plain"], capture_output=True, text=True,
                           timeout=60)
    # starting the resource tracker unblocked SIGTERM: the process dies of it (its child too)
    assert plain.returncode == -signal.SIGTERM and plain.stdout.split() == ["False", "False"], plain
    shielded = subprocess.run([sys.executable, str(tmp_path / "w.py"), "shield"], capture_output=True, text=True,
                              timeout=60, cwd=REPO)
    assert shielded.returncode == 0, shielded.stderr[-3000:]
    assert shielded.stdout.split() == ["True", "True", "alive", "True"]


# ----------------------------------------------------------------------------------------- on the cluster


@pytest.mark.slow
def test_a_broken_override_fails_the_job_before_ray_starts(slurm, tiny_qwen2, tmp_path):
    job, log, proc = slurm_cluster.sbatch(slurm, "broken", *tiny_raro(tiny_qwen2, tmp_path, tmp_path / "broken"),
                                          "model.path=/nonexistent/model")
    assert proc.wait(timeout=300) == 2, read_log(log)[-6000:]
    text = read_log(log)
    assert re.search(r"error: .*/nonexistent/model", text), text[-6000:]
    assert "the config was refused (exit code 2" in text and "Ray is up" not in text
    slurm_cluster.assert_cleaned_up(slurm)


def test_sbatch_accepts_the_70b_recipes_directives(slurm):
    proc = subprocess.run(["sbatch", "--test-only", *slurm_cluster.SBATCH_ON_TWO_NODES, "slurm/raro_70b.sbatch"],
                          cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr
