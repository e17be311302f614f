"""The sbatch recipes for real: a Slurm controller and two ``slurmd`` "nodes" (n1, n2) on this machine.

Each node gives the job one CPU, so Ray (one CPU per node) must place the two data-parallel ranks on
both nodes. Slurm comes from Debian's ``slurm-wlm`` (installed here when missing; we run as root), with
``auth/none`` (no munge), ports and state in a private directory, and every daemon stopped by PID.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_train_e2e import _raro_args

from megareason.trainer.loop import EXIT_STOPPED, stop_signals
from megareason.utils import free_port

REPO = Path(__file__).resolve().parent.parent

SLURM_CONF = """\
ClusterName={name}
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/none
CredType=cred/none
# A requeued job may start again after cred_expire seconds (default 120).
AuthInfo=cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
MinJobAge=300
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=1 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


def test_a_signal_asks_the_loop_to_stop_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    with stop_signals() as stop:
        assert stop.signal is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signal == signal.SIGUSR1
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second signal kills as usual
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
    with stop_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGTERM
    assert EXIT_STOPPED == 75  # slurm/ray_cluster.sh relies on it


def _ensure_slurm() -> None:
    """Debian's slurm-wlm, installed once (a no-op when present)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch")):
        return
    if os.geteuid() != 0:
        pytest.fail("Slurm is missing and installing it needs root: apt-get install slurm-wlm")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", "slurm-wlm"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:  # no package lists yet
        subprocess.run(["apt-get", "update", "-o", "DPkg::Lock::Timeout=600"], env=env, check=True,
                       capture_output=True)
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _port_block(size: int) -> int:
    """The first port of ``size`` consecutive free ports (for Ray's per-node port blocks)."""
    for base in range(21000, 32000 - size, 1000):
        socks = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {size} free consecutive ports")


@dataclass
class Cluster:
    name: str
    dir: Path
    env: dict[str, str]
    ray_tmp: Path


def _stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld and two slurmd (n1, n2) on loopback, private ports and state; stopped by PID afterwards."""
    _ensure_slurm()
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "run", "log"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    name = f"mr{os.getpid()}"
    conf.write_text(SLURM_CONF.format(name=name, dir=d, ctld_port=free_port("127.0.0.1"),
                                      n1_port=free_port("127.0.0.1"), n2_port=free_port("127.0.0.1")))
    ray_tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: Ray's socket paths are limited
    env = {**os.environ, "SLURM_CONF": str(conf), "MEGAREASON_PYTHON": sys.executable,
           "MEGAREASON_RAY_PORT_BASE": str(_port_block(400)), "MEGAREASON_RAY_TMPDIR": str(ray_tmp),
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    daemons = []
    try:
        for cmd, log in ((["slurmctld", "-D", "-i"], "ctld"), (["slurmd", "-D", "-N", "n1"], "n1"),
                         (["slurmd", "-D", "-N", "n2"], "n2")):
            with open(d / "log" / f"{log}.stdout", "w") as out:
                daemons.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            time.sleep(1)
        deadline = time.time() + 60
        while _run(env, "sinfo", "-h", "-o", "%T %D").stdout.split() != ["idle", "2"]:
            assert all(p.poll() is None for p in daemons), "a Slurm daemon exited; logs in " + str(d / "log")
            assert time.time() < deadline, "the two nodes did not become idle: " + _run(env, "sinfo").stdout
            time.sleep(1)
        yield Cluster(name, d, env, ray_tmp)
    finally:
        if daemons and daemons[0].poll() is None:  # cancel what a failed test left running, then stop
            _run(env, "scancel", "--partition=debug")
            deadline = time.time() + 90
            while _run(env, "squeue", "-h").stdout.strip() and time.time() < deadline:
                time.sleep(1)
        for p in reversed(daemons):
            _stop(p)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _run(env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _sbatch(cluster: Cluster, name: str, *overrides: str, timeout: float = 900) -> tuple[int, str]:
    """``sbatch --wait slurm/raro_70b.sbatch OVERRIDES`` on both nodes without GPUs: (exit code, job log)."""
    log = cluster.dir / f"{name}.out"
    cmd = ["sbatch", "--wait", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=30",
           f"--job-name={name}", f"--output={log}", "slurm/raro_70b.sbatch", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, (log.read_text() if log.exists() else "") + proc.stderr


def _assert_cleaned_up(cluster: Cluster) -> None:
    """No process of the jobs' Ray (they all name its temp dir) and no per-job folder is left."""
    assert not list((REPO / "outputs" / "slurm").glob(f"{cluster.name}-*"))
    deadline = time.time() + 60
    while True:
        left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).find(str(cluster.ray_tmp)) >= 0]
        if not left:
            return
        assert time.time() < deadline, f"Ray processes left: {[_cmdline(p)[:200] for p in left]}"
        time.sleep(1)


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _tiny_raro(tiny_qwen2: Path, tmp: Path, out: Path, *extra: str) -> list[str]:
    """configs/raro_70b.yaml cut down to the tiny model on CPU: the e2e RARO test's settings, 2 DP ranks,
    with its KL term (the reference log-probs of both replicas are concatenated by the driver)."""
    args = _raro_args(tiny_qwen2, tmp, out, "trainer.steps=2", "parallel.tensor_model_parallel_size=1",
                      "parallel.pipeline_model_parallel_size=1", "parallel.data_parallel_size=2",
                      "rollout.tensor_parallel_size=1", "rollout.dtype=float32", "optim.warmup_steps=0",
                      "algorithm.kl_coef=0.001", *extra)
    assert args[:4] == [sys.executable, "-m", "megareason.cli", "train"]
    return args[4:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_raro_70b_recipe_spans_two_nodes_and_a_broken_override_fails_the_job(slurm, tiny_qwen2, tmp_path):
    out = tmp_path / "raro"
    rc, log = _sbatch(slurm, "raro", *_tiny_raro(tiny_qwen2, tmp_path, out))
    assert rc == 0, log[-6000:]
    assert "Ray is up: 2 nodes" in log
    placed = re.search(r"actor: ranks on (\d) Ray node\(s\): (.*)", log)
    assert placed and placed.group(1) == "2", log[-6000:]
    assert len(set(re.findall(r"rank \d -> \S+ \((\w+)\)", placed.group(2)))) == 2
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "raro/critic_accuracy" in metrics[-1]
    assert (out / "checkpoints" / "step_00000002").is_dir()
    assert "driver exited with 0" in log and "Ray stopped" in log
    _assert_cleaned_up(slurm)

    rc, log = _sbatch(slurm, "broken", *_tiny_raro(tiny_qwen2, tmp_path, tmp_path / "broken"),
                      "model.path=/nonexistent/model")
    assert rc != 0, log[-6000:]
    assert re.search(r"error: .*/nonexistent/model", log), log[-6000:]
    assert "driver exited with 2" in log and "Ray stopped" in log
    _assert_cleaned_up(slurm)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_usr1_before_the_time_limit_checkpoints_requeues_and_the_next_run_resumes(slurm, tiny_qwen2, tmp_path):
    out = tmp_path / "requeue"
    log = slurm.dir / "requeue.out"
    cmd = ["sbatch", "--wait", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=30",
           "--job-name=requeue", f"--output={log}", "slurm/raro_70b.sbatch",
           *_tiny_raro(tiny_qwen2, tmp_path, out, "trainer.steps=3")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job = proc.stdout.readline().strip()
        deadline = time.time() + 900
        # The loop has started (its Tracker wrote metrics.jsonl): send what --signal=B:USR1@... sends.
        while not (out / "metrics.jsonl").exists():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-6000:]
            time.sleep(1)
        assert _run(slurm.env, "scancel", "--signal=USR1", "--batch", job).returncode == 0
        assert proc.wait(timeout=1200) == 0, log.read_text()[-6000:] + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert re.search(r"SIGUSR1: stopped after step [12] with a checkpoint", text), text[-6000:]
    assert f"requeueing job {job}" in text and "restart 1" in text and "resuming from" in text
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps  # each step once: the stop came after a step, never inside one
    assert "Restarts=1" in _run(slurm.env, "scontrol", "show", "job", job).stdout
    _assert_cleaned_up(slurm)
