"""The sbatch recipes for real, on a Slurm controller and two ``slurmd`` "nodes" on this machine
(``tests/slurm_cluster.py``, one cluster per session), plus the parts of the job that run without it.

Here: a broken override refused before Ray starts and ``sbatch --test-only`` of the recipe's directives. The
recipe's job end to end on both nodes, interrupted by SIGUSR1 and by a pre-emption's SIGTERM, requeued and
resumed to its golden curve, is test_nemo_run.py's (NeMo-Run submits the same job body this script runs).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
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
    assert lead.line() == ("pre-emption lead: a step 1000 s + a checkpoint of 8000 GB (written by 4 nodes, 2000 GB per "
                           "node at 2 GB/s = 1000 s), x 1.25 + 120 s teardown = #SBATCH --signal=B:USR1@2640")
    # the distributed optimizer's gather first: 100 GB a rank at 0.5 GB/s = 200 s more
    lead = preemption_lead(1000.0, 8e12, ranks=32, ranks_per_node=8, gather_bytes_per_rank=100e9)
    assert (lead.gather_s, lead.checkpoint_s) == (200.0, 1200.0)
    assert lead.seconds == 60 * -(-(2200 * 1.25 + 120) // 60) == 2880
    assert "(its optimizer state gathered, 100 GB per rank at 0.5 GB/s = 200 s, then written by 4 nodes" in lead.line()
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
    # the distributed optimizer: each of the TP 8 x PP 4 shards' ranks gathers 12 bytes a parameter of its
    # shard, 26.46 GB, at 0.5 GB/s (measured on an H200: 0.52) = 52.9 s before the write
    assert need.gather_bytes_per_rank == pytest.approx(12 * 70_553_706_496 / 32)
    assert need.checkpoint_s == pytest.approx(52.92 + 61.73, abs=0.01)
    assert "26 GB per rank at 0.5 GB/s = 53 s, then written by 8 nodes, 123 GB per node at 2 GB/s = 62 s" in need.line()
    plain = plan_lead(plan, load_config("raro_70b", ["optim.use_distributed_optimizer=false"]))
    assert plain.gather_s == 0 and plain.checkpoint_s == pytest.approx(61.73, abs=0.01)
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


RAY_DRIVER = """\
import os, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0)
def node_env():
    from megareason.ports import block_base
    return os.environ.get("MEGAREASON_PORT_BASE"), block_base()

print("cpus", int(ray.cluster_resources()["CPU"]), flush=True)
print("env", *ray.get(node_env.remote()), flush=True)
input()  # hold the driver while the test counts the node's workers
"""


def _ray_workers(root: int) -> list[int]:
    """Ray's worker processes (``default_worker.py``) under ``root``."""
    def cmd(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""

    return [p for p in ray_node.process_tree(root) if "default_worker.py" in cmd(p)]


def test_a_ray_node_declaring_224_cpus_starts_no_worker_per_cpu_and_gives_its_workers_the_port_block(tmp_path):
    """A DGX H100 node with SMT: Slurm says 224 CPUs, `ray start --num-cpus=224`. Each Ray worker holds one
    of the node's 126 worker ports, and Ray's default idle-worker limit is the CPU count: the job's Ray node
    (slurm/ray_cluster.sh) caps it and turns prestarting off (measured with Ray 2.60: a driver's first task
    starts one worker, not one per CPU), and its workers inherit the node's service port block."""
    base = slurm_cluster.port_block(200)
    job_dir, tmp = tmp_path / "job", Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short socket paths
    job_dir.mkdir()
    env = {**os.environ, "MR_NODES": "n1 ", "SLURMD_NODENAME": "n1", "MR_RAY_PORT_BASE": str(base),
           "MR_HEAD_IP": "127.0.0.1", "MR_PYTHON": sys.executable, "MR_JOBDIR": str(job_dir),
           "MR_RAY_TMPDIR": str(tmp), "MR_NODE_SLOTS": "4", "SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "224",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(REPO)}
    node = subprocess.Popen(["bash", str(REPO / "slurm" / "ray_cluster.sh"), "node"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver = None
    try:
        (tmp_path / "driver.py").write_text(RAY_DRIVER)
        driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), f"127.0.0.1:{base}"], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert node.stdout.readline().endswith(
            f"megareason-ray-node n1: ray start: 224 CPUs, worker ports {base + 10}-{base + 135}, services from port "
            f"{base + 136}, idle workers <= 32, worker prestart off\n")
        assert driver.stdout.readline().split() == ["cpus", "224"], driver.stderr.read()[-3000:]
        assert driver.stdout.readline().split() == ["env", str(base + 136), str(base + 136)]
        time.sleep(5)  # prestarted workers would be starting by now
        workers = _ray_workers(node.pid)
        assert 1 <= len(workers) <= 4, workers  # the task's worker (and Ray's own), not 224
        raylet = next(p for p in ray_node.process_tree(node.pid)
                      if "raylet" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0")[0])
        environ = dict(v.split("=", 1) for v in Path(f"/proc/{raylet}/environ").read_text().split("\0") if "=" in v)
        assert environ["RAY_prestart_worker_first_driver"] == "0" and environ["RAY_num_workers_soft_limit"] == "32"
        args = Path(f"/proc/{raylet}/cmdline").read_text()
        assert f"--min_worker_port={base + 10}" in args and f"--max_worker_port={base + 135}" in args, args
    finally:
        if driver is not None:
            driver.kill()
            driver.wait()
        (job_dir / ray_node.STOP_FILE).touch()
        try:
            node.wait(timeout=60)
        finally:
            if node.poll() is None:
                node.kill()
            shutil.rmtree(tmp, ignore_errors=True)


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


# The job's checks before Ray (slurm/ray_cluster.sh's functions, run by bash here; slurm_job.py run-dir).


def _bash(script: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``script`` after sourcing slurm/ray_cluster.sh (its functions, nothing run)."""
    return subprocess.run(["bash", "-c", f'source "{REPO}/slurm/ray_cluster.sh" || exit 99\n{script}'], cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120)


def _git_repo(path: Path) -> str:
    """A checkout with one commit; its commit hash."""
    path.mkdir(parents=True)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def _commit(root: Path, message: str) -> str:
    """Commit everything in the checkout ``root``; the new commit's hash."""
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", message], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def test_the_hosts_of_a_job_are_its_distinct_node_addresses_with_loopback_one_host():
    def count(*addrs: str) -> int:
        proc = _bash(f"_mr_count_hosts {' '.join(addrs)}")
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    assert count("127.0.0.1", "127.0.0.1") == 1  # tests/slurm_cluster.py: two slurmd "nodes" on one machine
    assert count("127.0.0.1", "localhost", "127.0.1.1") == 1
    assert count("10.1.0.1", "10.1.0.2", "10.1.0.2") == 2
    assert count("127.0.0.1", "10.1.0.2") == 2


def test_the_first_start_snapshots_the_code_the_job_runs_into_the_run_folder(tmp_path):
    """What a git checkout would run, as it is now: megareason/, configs/, slurm/ and pyproject.toml, their
    tracked files with uncommitted changes and the untracked files git does not ignore; nothing else. Without
    git: those folders, without __pycache__."""
    root, jobdir, run = tmp_path / "checkout", tmp_path / "job", tmp_path / "run"
    _git_repo(root)
    for rel, text in (("megareason/a.py", "a = 1\n"), ("configs/c.yaml", "k: 1\n"), ("slurm/s.sh", "true\n"),
                      ("docs/d.md", "doc\n"), (".gitignore", "*.log\n")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    commit = _commit(root, "code")
    (root / "megareason" / "a.py").write_text("a = 2\n")  # uncommitted
    (root / "megareason" / "new.py").write_text("b = 1\n")  # untracked, not ignored
    (root / "megareason" / "junk.log").write_text("x")  # ignored
    jobdir.mkdir()
    env = {"MR_ROOT": str(root), "MR_JOBDIR": str(jobdir), "SLURM_JOB_ID": "7", "SLURM_CLUSTER_NAME": "c"}
    proc = _bash(f'_mr_snapshot "{run}" && echo "$MR_CODE"', env)
    snap = run / "code" / "c-7"
    assert proc.returncode == 0 and proc.stdout.strip() == str(snap), proc.stdout + proc.stderr
    files = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())
    assert files == [".megareason-code", "configs/c.yaml", "megareason/a.py", "megareason/new.py", "slurm/s.sh"]
    assert (snap / "megareason" / "a.py").read_text() == "a = 2\n"
    assert re.fullmatch(rf"{root} {commit} dirty:[0-9a-f]{{12}}\n", (snap / ".megareason-code").read_text())
    assert (jobdir / "checkout").read_text() == f"{snap}\n" and not (run / "code" / "c-7.partial").exists()
    plain = tmp_path / "plain"  # not a git checkout
    (plain / "megareason" / "__pycache__").mkdir(parents=True)
    (plain / "megareason" / "m.py").write_text("m = 1\n")
    (plain / "megareason" / "__pycache__" / "m.pyc").write_text("")
    (plain / "tests").mkdir()
    proc = _bash(f'_mr_snapshot "{run}"', {**env, "MR_ROOT": str(plain), "SLURM_JOB_ID": "8"})
    snap = run / "code" / "c-8"
    assert proc.returncode == 0, proc.stderr
    assert sorted(str(p.relative_to(snap)) for p in snap.rglob("*")) == [".megareason-code", "megareason",
                                                                          "megareason/m.py"]
    assert (snap / ".megareason-code").read_text() == f"{plain} not a git checkout\n"


def test_the_job_folder_keeps_only_the_code_record_across_a_requeue(tmp_path):
    jobdir = tmp_path / "job"
    for requeued, kept in ((1, ["checkout"]), (0, None)):
        jobdir.mkdir(exist_ok=True)
        for name in ("checkout", "driver.pid", "run_dir", "ray.up"):
            (jobdir / name).write_text("x")
        proc = _bash("_mr_clean_jobdir", {"MR_JOBDIR": str(jobdir), "MR_REQUEUED": str(requeued)})
        assert proc.returncode == 0, proc.stderr
        assert (sorted(p.name for p in jobdir.iterdir()) if jobdir.exists() else None) == kept


def _fake_slurm(tmp: Path, addrs: dict[str, str]) -> dict[str, str]:
    """The environment of a job script on nodes ``addrs`` (name -> NodeAddr) with stand-ins for scontrol
    (the nodes; requeue accepted) and srun (runs its command here, in its --chdir, except the node check,
    which passes; each command logged in tmp/srun.log)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    lines = {n: f"NodeName={n} Arch=x86_64 NodeAddr={a} NodeHostName={n}" for n, a in addrs.items()}
    cases = "\n".join(f'  "show node {n}") echo "{line}" ;;' for n, line in lines.items())
    every = "; ".join(f'echo "{line}"' for line in lines.values())
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
case "$1 $2${{3:+ $3}}" in
{cases}
  "show node"*) {every} ;;
  "show hostnames"*) printf '%s\\n' {' '.join(addrs)} ;;
  requeue*) ;;
  *) echo "fake scontrol: $*" >&2; exit 1 ;;
esac
""")
    (bin_dir / "srun").write_text("""#!/bin/bash
args="$*"
dir=.
while [[ $1 == -* ]]; do
    [[ $1 == --chdir=* ]] && dir=${1#--chdir=}
    [[ $1 == -w ]] && shift
    shift
done
echo "$args PYTHONPATH=$PYTHONPATH PYTHONSAFEPATH=$PYTHONSAFEPATH" >> "$FAKE_SRUN_LOG"
[[ " $* " == *" megareason.launch.node_check "* ]] && exit 0
cd "$dir" && exec "$@"
""")
    for f in ("scontrol", "srun"):
        (bin_dir / f).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SRUN_LOG": str(tmp / "srun.log"),
            "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": ",".join(addrs), "SLURM_CPUS_ON_NODE": "1",
            "SLURM_CLUSTER_NAME": "fake", "SLURM_RESTART_COUNT": "0", "MEGAREASON_PYTHON": sys.executable,
            "SLURMD_NODENAME": next(iter(addrs)),
            "PYTHONPATH": str(REPO), "MEGAREASON_RAY_TMPDIR": str(tmp)}


def test_a_job_across_hosts_refuses_a_run_folder_inside_the_checkout_before_ray_starts(tmp_path):
    root = tmp_path / "checkout"
    _git_repo(root)
    env = {**_fake_slurm(tmp_path, {"n1": "10.9.0.1", "n2": "10.9.0.2"}), "MEGAREASON_ROOT": str(root)}
    proc = _bash("megareason_slurm_run grpo_smollm2_cpu trainer.output_dir=runs/x", env, cwd=root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "grpo_smollm2_cpu on 2 nodes (n1 n2) on 2 host(s)," in out, out
    assert (f"error: the run folder {root / 'runs' / 'x'} (trainer.output_dir) lies inside the checkout {root}, on a "
            "job across 2 hosts") in out and "trainer.output_dir=/scratch/$USER/RUN" in out
    assert "the config was refused (exit code 2" in out and "Ray was not started" in out
    steps = (tmp_path / "srun.log").read_text()
    assert "node_check --nodes=2 --hosts=2 " in steps and "ray_cluster.sh node" not in steps
    assert f"run-dir --hosts=2 --checkout={root} --config-name grpo_smollm2_cpu" in steps
    assert not (root / "outputs" / "slurm" / "fake-41").exists()  # the job folder went with the job


def test_a_requeued_job_runs_every_step_from_its_snapshot_whatever_the_checkout_holds(tmp_path):
    root = tmp_path / "checkout"
    _git_repo(root)
    snap = tmp_path / "run" / "code" / "fake-41"  # the first start's snapshot: its run-dir says so and stops
    shutil.copytree(REPO / "megareason", snap / "megareason", ignore=shutil.ignore_patterns("__pycache__"))
    (snap / "megareason" / "launch" / "slurm_job.py").write_text(
        "import sys; print('the snapshot ran run-dir', file=sys.stderr); raise SystemExit(2)\n")
    (snap / ".megareason-code").write_text(f"{root} {'0' * 40} clean\n")
    (snap / "slurm").mkdir()  # the snapshot's job script, which the checkout's sources again
    (snap / "slurm" / "ray_cluster.sh").write_text(
        (REPO / "slurm" / "ray_cluster.sh").read_text().replace("megareason-slurm: $*", "the snapshot's script: $*"))
    jobdir = root / "outputs" / "slurm" / "fake-41"
    jobdir.mkdir(parents=True)
    (jobdir / "checkout").write_text(f"{snap}\n")
    env = {**_fake_slurm(tmp_path, {"n1": "127.0.0.1", "n2": "127.0.0.1"}), "MEGAREASON_ROOT": str(root),
           "SLURM_RESTART_COUNT": "1", "MEGAREASON_CONTAINER_IMAGE": "/images/megareason.sqsh"}
    proc = _bash("megareason_slurm_run grpo_smollm2_cpu", env, cwd=root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "the snapshot ran run-dir" in out, out
    assert "the snapshot's script: the config was refused (exit code 2" in out, out
    banner, code = out.index("job 41 (restart 1): grpo_smollm2_cpu"), out.index(f"code: {snap}, the snapshot of {root}")
    assert banner < code < out.index("the config was refused")  # logged where the run begins
    steps = (tmp_path / "srun.log").read_text().splitlines()
    assert len(steps) == 2 and "--nodes=2 --hosts=1 " in steps[0]  # node check (one host: the test cluster's)
    assert "run-dir" in steps[1] and "ray_cluster.sh node" not in "".join(steps)
    for step in steps:  # the snapshot first, never the working directory; the job's own container
        assert f"PYTHONPATH={snap}:" in step and "PYTHONSAFEPATH=1" in step, step
        assert "--container-image=/images/megareason.sqsh --container-name=megareason_41 " in step, step
        assert "--no-container-mount-home" in step and " -m megareason.launch.job_env --ephemeral -- " in step
    (snap / ".megareason-code").unlink()  # a snapshot that is gone: a new job must take one
    jobdir.mkdir(parents=True)  # (the refused run's job folder went with it)
    (jobdir / "checkout").write_text(f"{snap}\n")
    proc = _bash("megareason_slurm_run grpo_smollm2_cpu", env, cwd=root)
    assert proc.returncode == 1 and f"the snapshot of the code this job started with, {snap}, is gone" in proc.stdout


def test_a_head_address_that_resolves_to_loopback_fails_a_job_across_hosts(tmp_path):
    root = tmp_path / "checkout"
    _git_repo(root)
    env = {**_fake_slurm(tmp_path, {"n1": "127.0.1.1", "n2": "10.9.0.2"}), "MEGAREASON_ROOT": str(root)}
    proc = _bash("megareason_slurm_run grpo_smollm2_cpu", env, cwd=root)
    assert proc.returncode == 1 and "resolves to 127.0.1.1 (loopback) here, on a job across 2 hosts" in proc.stdout
    assert not (tmp_path / "srun.log").exists()


def test_run_dir_runs_the_train_preflight_and_refuses_a_run_folder_inside_the_checkout(tiny_qwen2, tmp_path,
                                                                                         monkeypatch, capsys):
    from megareason.launch import slurm_job

    checkout = tmp_path / "checkout"

    def run_dir(hosts: int, out: Path, *overrides: str) -> int:
        return slurm_job.main(["run-dir", f"--hosts={hosts}", f"--checkout={checkout}", "--config-name",
                               "grpo_smollm2_cpu", f"model.path={tiny_qwen2}", f"trainer.output_dir={out}", *overrides])

    inside = checkout / "outputs" / "run"
    assert run_dir(2, inside) == 2
    assert capsys.readouterr().err.startswith(f"error: the run folder {inside} (trainer.output_dir) lies inside")
    assert run_dir(1, inside) == 0  # one host: allowed
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(inside)
    outside = tmp_path / "scratch" / "run"
    assert run_dir(8, outside) == 0
    capsys.readouterr()
    monkeypatch.setattr("shutil.disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0))
    assert run_dir(8, outside) == 2  # the preflight's free-space check, before Ray
    assert capsys.readouterr().err.startswith(f"error: output folder {outside} has 0.0 MB free")
    assert run_dir(1, outside, "trainer.keep_last=0") == 2  # the config's own checks
    assert "trainer.keep_last" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- on the cluster


@pytest.mark.slow
def test_a_broken_override_fails_the_job_before_ray_starts(slurm, tiny_qwen2, tmp_path, request):
    job, log, proc = slurm_cluster.sbatch(slurm, "broken", *tiny_raro(tiny_qwen2, tmp_path, tmp_path / "broken"),
                                          "model.path=/nonexistent/model")
    request.addfinalizer(lambda: slurm.cancel(job))
    assert proc.wait(timeout=300) == 2, read_log(log)[-6000:]
    text = read_log(log)
    assert re.search(r"error: .*/nonexistent/model", text), text[-6000:]
    assert "the config was refused (exit code 2" in text and "Ray is up" not in text
    slurm_cluster.assert_cleaned_up(slurm)


@pytest.mark.slow
def test_a_224_cpu_node_starts_ray_with_the_port_settings_and_a_requeue_runs_the_code_the_job_started_with(
        slurm, tiny_qwen2, tmp_path, request):
    """The job on n1 and n3 (224 logical CPUs, a DGX H100 node with SMT), run from a checkout of its own: its
    first run snapshots the checkout's code into the run folder; a SIGUSR1 before the driver starts requeues it
    once Ray is up on both nodes (Ray sees 225 CPUs; n3's Ray starts with the job's worker ports, the
    idle-worker limit and no prestart, and starts no worker per CPU). Before the requeued run starts, a commit
    breaks the checkout's run-dir step and edits its job script, and the model folder goes: the requeued run
    runs the snapshot's job script and run-dir, which refuses the missing model (exit 2, no further requeue),
    never the edited ones."""
    root = tmp_path / "checkout"
    _git_repo(root)
    for folder in ("slurm", "megareason", "configs"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    first = _commit(root, "the code")
    env = {**slurm.env, "MEGAREASON_ROOT": str(root), "PYTHONPATH": str(REPO)}
    log, out, model = tmp_path / "job.out", tmp_path / "run", tmp_path / "model"
    shutil.copytree(tiny_qwen2, model)
    proc = subprocess.run(["sbatch", "--parsable", "--partition=big", "--nodes=2", "--gpus-per-node=0",
                           "--cpus-per-task=1", "--time=90", "--job-name=big", f"--output={log}",
                           "slurm/raro_70b.sbatch", *tiny_raro(model, tmp_path, out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=60)
    job = proc.stdout.strip()
    assert proc.returncode == 0 and job.isdigit(), proc.stderr
    request.addfinalizer(lambda: slurm.cancel(job))
    snapshot = out / "code" / f"{slurm.name}-{job}"
    slurm_cluster.wait_for_text(log, f"code: {snapshot}, the snapshot of {root} {first} clean", 300)
    assert slurm.run("scancel", "--signal=USR1", "--batch", job).returncode == 0
    run_dir_step = root / "megareason" / "launch" / "slurm_job.py"
    run_dir_step.write_text('raise SystemExit("the edited checkout ran")\n')
    script = root / "slurm" / "ray_cluster.sh"  # the job script's own functions, sourced from the checkout
    script.write_text(script.read_text().replace("megareason-slurm: $*", "the edited job script: $*"))
    _commit(root, "an edit after the start")
    shutil.rmtree(model)
    state = slurm.wait_for_job(job, timeout=600)
    text = read_log(log)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("FAILED", "2:0", "1"), (state, text[-6000:])
    run1, run2 = text.split("(restart 1)")
    assert "SIGUSR1 before the driver started: requeueing once Ray is up" in run1, run1[-6000:]
    assert "Ray is up: 2 nodes, 0 GPUs, 225 CPUs" in run1 and f"requeueing job {job}" in run1
    b = int(slurm.env["MEGAREASON_RAY_PORT_BASE"]) + 200  # n3: the job's second node
    assert (f"megareason-ray-node n3: ray start: 224 CPUs, worker ports {b + 10}-{b + 135}, services from port "
            f"{b + 136}, idle workers <= 32, worker prestart off") in run1, run1[-6000:]
    n3_logs = out / "ray_logs" / "restart_0" / "n3"
    assert (n3_logs / "raylet.out").is_file() and len(list(n3_logs.glob("python-core-worker-*.log"))) <= 4
    # The requeued run: the snapshot, as at the first start, the edit nowhere.
    assert f"code: {snapshot}, the snapshot of {root} {first} clean at the job's first start" in run2, run2[-6000:]
    assert "the edited checkout ran" not in run2 and re.search(rf"error: .*{model}", run2), run2[-6000:]
    assert "the edited job script" not in run2 and "megareason-slurm: the config was refused" in run2
    assert "the config was refused (exit code 2" in run2 and "megareason-ray-node" not in run2
    assert (snapshot / "megareason" / "launch" / "slurm_job.py").read_text() == \
        (REPO / "megareason" / "launch" / "slurm_job.py").read_text()
    assert not (snapshot / "code.py").exists()  # only what the job runs: megareason/, configs/, slurm/
    assert not list((root / "outputs" / "slurm").iterdir())  # the job folder went with the job
    slurm_cluster.assert_cleaned_up(slurm)


_LOSES_A_NODE = """#!/bin/bash
# The job script's failure path on two nodes: a step on each (as Ray's), a node that fails, then what the job
# script does when the driver fails (_mr_driver_exited 1), with its own traps.
source "$MR_TEST_REPO/slurm/ray_cluster.sh"
MR_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\\n' ' ')
echo "restart ${SLURM_RESTART_COUNT:-0} on ${MR_NODES% }" >> "$MR_TEST_OUT/runs"
(( ${SLURM_RESTART_COUNT:-0} > 0 )) && exit 0
MR_JOBDIR=$MR_TEST_OUT/job-$SLURM_JOB_ID MR_SIGNALS=0 MR_STOP_REQUESTED=0 MR_DRIVER= MR_REQUEUED=0
MR_DRIVER_PIDFILE=$MR_JOBDIR/driver.pid
mkdir -p "$MR_JOBDIR"
trap '_mr_on_signal USR1' USR1
trap '_mr_on_signal TERM' TERM
trap '_mr_teardown' EXIT
srun --nodes=2 --ntasks=2 --ntasks-per-node=1 bash -c \\
    'touch "$0/up.$SLURMD_NODENAME"; while [[ ! -e $0/ray.stop ]]; do sleep 0.2; done' "$MR_JOBDIR" &
MR_RAY_STEPS=($!)
while [[ ! -e $MR_TEST_OUT/failed ]]; do sleep 0.2; done
_mr_driver_exited 1
"""


def _job_on_two_nodes(slurm, out: Path, request) -> tuple[str, Path, str, str]:
    """Submit the job above to partition ``all`` (n1, n2, n3) on two nodes; once its step runs on both, the
    job's id, its log, the node that fails (the second of the two: the first runs the job script) and the
    spare one. Which two Slurm picks depends on which were free first."""
    out.mkdir()
    script = out / "loses_a_node.sbatch"
    script.write_text(_LOSES_A_NODE)
    log = out / "job.out"
    env = {**slurm.env, "MR_TEST_REPO": str(REPO), "MR_TEST_OUT": str(out), "MEGAREASON_NODE_PROBE_S": "20"}
    proc = subprocess.run(["sbatch", "--parsable", "--partition=all", "--nodes=2", "--ntasks-per-node=1",
                           "--cpus-per-task=1", "--time=30", "--requeue", "--open-mode=append", f"--output={log}",
                           str(script)], env=env, capture_output=True, text=True, timeout=60)
    job = proc.stdout.strip()
    assert proc.returncode == 0 and job.isdigit(), proc.stderr
    request.addfinalizer(lambda: slurm.cancel(job))
    deadline = time.time() + 120
    while True:
        runs = (out / "runs").read_text().split() if (out / "runs").exists() else []
        nodes = runs[3:5]
        if len(nodes) == 2 and all((out / f"job-{job}" / f"up.{n}").exists() for n in nodes):
            return job, log, nodes[1], ({"n1", "n2", "n3"} - set(nodes)).pop()
        assert time.time() < deadline, (read_log(log), runs, slurm.job_state(job))
        time.sleep(0.5)


@pytest.mark.slow
def test_a_node_that_fails_mid_job_ends_in_a_requeue_without_it_on_the_loopback_cluster(slurm, tmp_path, request):
    """Two jobs of two nodes in partition ``all`` (n1, n2, n3) start with a step on each of their nodes, and
    their driver fails after the second node did.
    1. That node drained (what a health check does after a GPU's XID error; its slurmd still answers): the job
       script finds it DRAIN, requeues the job held, adds the node to its ExcNodeList and releases it; it runs
       again on the first node and the spare one.
    2. That node dead (its slurmd, its slurmstepd and tasks killed: ``kill_node``): the job script finds that
       it does not answer (the real scontrol and a probe step that cannot start there) and waits for Slurm,
       which marks it DOWN (set by the test at once instead of SlurmdTimeout later) and requeues the job
       itself; its SIGTERM ends the script, and the job runs again on the first node and the spare one."""
    for node in slurm_cluster.NODES:
        request.addfinalizer(lambda node=node: slurm_cluster.restart_node(slurm, node))
        request.addfinalizer(lambda node=node: slurm.run("scontrol", "update", f"NodeName={node}", "State=RESUME"))
    out = tmp_path / "drained"
    job, log, bad, spare = _job_on_two_nodes(slurm, out, request)
    slurm.run("scontrol", "update", f"NodeName={bad}", "State=DRAIN", "Reason=XID 79 (the test)")
    (out / "failed").touch()
    state = slurm.wait_for_job(job, timeout=300)
    text = read_log(log)
    first, again = (out / "runs").read_text().splitlines()
    assert first.startswith("restart 0 on ") and first.endswith(bad), text
    assert again == "restart 1 on " + " ".join(sorted({first.split()[3], spare})), (first, again, text)
    assert (state["JobState"], state["Restarts"], state["ExcNodeList"]) == ("COMPLETED", "1", bad), (state, text)
    assert re.search(rf"node\(s\) {bad} down or not answering \({bad} \S*DRAIN\S*\): requeueing job {job} without "
                     "them; the next run resumes from the latest checkpoint", text), text
    assert f"job {job} requeued held, its ExcNodeList set to {bad}" in text and f"job {job} released" in text, text
    assert "waiting up to" not in text and "could not be excluded" not in text, text
    slurm.run("scontrol", "update", f"NodeName={bad}", "State=RESUME")

    out = tmp_path / "dead"
    job, log, bad, spare = _job_on_two_nodes(slurm, out, request)
    assert slurm_cluster.kill_node(slurm, bad)  # at least its task and its slurmstepd
    (out / "failed").touch()
    slurm_cluster.wait_for_text(log, "SlurmdTimeout (60 s) and requeues the job without them; waiting up to 110 s", 120)
    # What Slurm does SlurmdTimeout (60 s here) after the node's last answer, at once.
    slurm.run("scontrol", "update", f"NodeName={bad}", "State=DOWN", "Reason=killed by the test")
    state = slurm.wait_for_job(job, timeout=300)
    text = read_log(log)
    first, again = (out / "runs").read_text().splitlines()
    assert again == "restart 1 on " + " ".join(sorted({first.split()[3], spare})), (first, again, text)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), (state, text)
    assert (f"node(s) {bad} down or not answering ({bad} no-answer): requeueing job {job} without them; the next "
            "run resumes from the latest checkpoint") in text, text
    assert f"SIGTERM: Slurm requeued the job after the failure of node(s) {bad} (Restarts=1)" in text, text
    assert "requeued held" not in text and "did not requeue" not in text, text


def test_sbatch_accepts_the_70b_recipes_and_the_site_checks_directives(slurm):
    for script in ("slurm/raro_70b.sbatch", "slurm/site_check.sbatch"):
        proc = subprocess.run(["sbatch", "--test-only", *slurm_cluster.SBATCH_ON_TWO_NODES, script],
                              cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "to start at" in proc.stderr, (script, proc.stderr)
