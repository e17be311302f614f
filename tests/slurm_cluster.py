"""A real Slurm cluster on this machine for the launch tests: slurmctld and three ``slurmd`` "nodes".

Partition ``debug`` (the default): n1 and n2, one CPU each, so Ray (one CPU per node) must place two
data-parallel ranks on both nodes. Partition ``big``: n1 and n3, which declares a DGX H100 node's 224 logical
CPUs (2 sockets x 56 cores x 2 threads; ``SlurmdParameters=config_overrides`` lets slurmd take the declared
shape over this machine's), for a job whose Ray node must not start a worker per CPU. Partition ``all``: the
three, for a job that loses a node (``kill_node``) and is requeued onto the others.
Slurm comes from Debian's ``slurm-wlm`` (installed when missing; the tests run as root), with ``auth/none``
(no munge), ports and state in a private directory, every daemon bound to loopback and stopped by PID.
One cluster serves every test of a session (``conftest.py``'s ``slurm`` fixture).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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
SlurmdParameters=config_overrides
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=1 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=1 RealMemory=4000 State=UNKNOWN
NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n3_port} RealMemory=4000 State=UNKNOWN \
  Sockets=2 CoresPerSocket=56 ThreadsPerCore=2
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
PartitionName=big Nodes=n1,n3 MaxTime=INFINITE State=UP
PartitionName=all Nodes=n[1-3] MaxTime=INFINITE State=UP
"""


NODES = ("n1", "n2", "n3")
# The states a job ends in; any other (PENDING, RUNNING, COMPLETING between a run and its requeue, ...) is live.
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED")


@dataclass
class Cluster:
    name: str
    dir: Path
    env: dict[str, str]
    ray_tmp: Path
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def job_state(self, job: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...); empty once it is gone."""
        out = self.run("scontrol", "show", "job", job).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_for_job(self, job: str, timeout: float) -> dict[str, str]:
        """Poll until the job is COMPLETED/FAILED/CANCELLED/TIMEOUT (requeues included); its final state."""
        deadline = time.time() + timeout
        while True:
            state = self.job_state(job)
            if state.get("JobState") in TERMINAL:
                return state
            assert time.time() < deadline, f"job {job} did not finish within {timeout} s: {state}"
            time.sleep(2)


    def is_live(self, job: str) -> bool:
        return self.job_state(job).get("JobState", "COMPLETED") not in TERMINAL

    def cancel(self, job: str, timeout: float = 120) -> None:
        """Cancel ``job`` if it is still queued or running and wait until it ended: a test that failed half-way
        must not leave its job holding the nodes (and its Ray running) for the tests after it."""
        if not self.is_live(job):
            return
        self.run("scancel", job)
        deadline = time.time() + timeout
        while self.is_live(job) and time.time() < deadline:
            time.sleep(1)


def ensure_slurm() -> None:
    """Debian's slurm-wlm, installed once (a no-op when present)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch")):
        return
    if os.geteuid() != 0:
        raise RuntimeError("Slurm is missing and installing it needs root: apt-get install slurm-wlm")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", "slurm-wlm"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:  # no package lists yet
        subprocess.run(["apt-get", "update", "-o", "DPkg::Lock::Timeout=600"], env=env, check=True,
                       capture_output=True)
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])


def ensure_bubblewrap() -> str:
    """Debian's bubblewrap (``bwrap``), installed once like slurm-wlm; its path."""
    if not shutil.which("bwrap"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", "bubblewrap"]
        if subprocess.run(install, env=env, capture_output=True).returncode != 0:  # no package lists yet
            subprocess.run(["apt-get", "update", "-o", "DPkg::Lock::Timeout=600"], env=env, check=True,
                           capture_output=True)
            subprocess.run(install, env=env, check=True, capture_output=True)
    return shutil.which("bwrap")


# An `srun` in front of the real one (first on the job's PATH) that runs each job step's command the way enroot
# runs a container with its defaults and pyxis' --no-container-mount-home: the whole file system read-only (the
# root, the Python environment, the checkout), no home (HOME names a folder that does not exist), only the
# folders in MR_SANDBOX_WRITABLE (colon-separated: the run folder, the job's node-local scratch) writable; /dev
# (with /dev/shm) and the network as on the host, as in a container. The options before the command are srun's.
SANDBOX_SRUN = """\
#!/bin/bash
opts=()
while (( $# )); do
    case $1 in
        -w|-N|-n|-c) opts+=("$1" "$2"); shift 2 ;;
        -*) opts+=("$1"); shift ;;
        *) break ;;
    esac
done
echo "read-only sandbox: $*" >&2
binds=()
IFS=: read -ra writable <<< "$MR_SANDBOX_WRITABLE"
for dir in "${writable[@]}"; do binds+=(--bind "$dir" "$dir"); done
# bwrap stays as the step's task, waiting for the sandboxed command: it ignores SIGTERM (Slurm signals every
# process of the step), which the command gets back as usual, as a container's processes (the task itself) do.
exec "$MR_SANDBOX_SRUN" "${opts[@]}" bash -c 'trap "" TERM; exec "$@"' sandbox "$MR_SANDBOX_BWRAP" \\
    --ro-bind / / --dev-bind /dev /dev --proc /proc "${binds[@]}" --setenv HOME /home/no-home \\
    -- env --default-signal=TERM "$@"
"""


def sandboxed(env: dict[str, str], folder: Path, *writable: Path) -> dict[str, str]:
    """``env`` for a job whose steps run in the read-only sandbox of ``SANDBOX_SRUN`` (written to ``folder``),
    with ``writable`` (existing folders) the only ones they can write."""
    bwrap, real = ensure_bubblewrap(), shutil.which("srun", path=env.get("PATH"))
    (folder / "srun").write_text(SANDBOX_SRUN)
    (folder / "srun").chmod(0o755)
    return {**env, "PATH": f"{folder}:{env.get('PATH', os.defpath)}", "MR_SANDBOX_SRUN": real,
            "MR_SANDBOX_BWRAP": bwrap, "MR_SANDBOX_WRITABLE": ":".join(map(str, writable))}


def port_block(size: int) -> int:
    """The first port of ``size`` consecutive free ports below 9000, where slurm/ray_cluster.sh's own
    default blocks lie (below the ephemeral range on any node: nothing but a server asking for a port by
    number takes one of them)."""
    for base in range(2000, 9000 - size, 1000):
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
    raise RuntimeError(f"no {size} free consecutive ports below 9000")


def start(base_dir: Path) -> Cluster:
    """slurmctld and three slurmd on loopback, private ports and state under ``base_dir``; idle when returned."""
    ensure_slurm()
    d = base_dir
    for sub in ("state", "spool", "run", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    conf = d / "slurm.conf"
    name = f"mr{os.getpid()}"
    # The Ray block holds 4 node slots of 200 ports (slurm/ray_cluster.sh); the daemons take the 4 after it.
    ray_base = port_block(804)
    conf.write_text(SLURM_CONF.format(name=name, dir=d, ctld_port=ray_base + 800, n1_port=ray_base + 801,
                                      n2_port=ray_base + 802, n3_port=ray_base + 803))
    ray_tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: Ray's socket paths are limited
    env = {**os.environ, "SLURM_CONF": str(conf), "MEGAREASON_PYTHON": sys.executable,
           "MEGAREASON_RAY_PORT_BASE": str(ray_base), "MEGAREASON_RAY_TMPDIR": str(ray_tmp),
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    cluster = Cluster(name, d, env, ray_tmp)
    try:
        for cmd, log in ((["slurmctld", "-D", "-i"], "ctld"), *((["slurmd", "-D", "-N", n], n) for n in NODES)):
            with open(d / "log" / f"{log}.stdout", "w") as out:
                cluster.daemons.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            time.sleep(1)
        deadline = time.time() + 60
        while set(cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.splitlines()) != {f"{n} idle" for n in NODES}:
            if not all(p.poll() is None for p in cluster.daemons):
                raise RuntimeError("a Slurm daemon exited; logs in " + str(d / "log"))
            if time.time() > deadline:
                raise RuntimeError("the nodes did not become idle: " + cluster.run("sinfo").stdout)
            time.sleep(1)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _environ(proc_dir: Path) -> list[bytes]:
    try:
        return (proc_dir / "environ").read_bytes().split(b"\0")
    except OSError:
        return []


def kill_node(cluster: Cluster, node: str) -> list[int]:
    """What a crash of ``node`` does to a job: its slurmd, every task it started (this cluster's
    ``SLURM_CONF`` and ``SLURMD_NODENAME=node`` in their environment, and their children, which inherit it)
    and the slurmstepd above each die at once, by SIGKILL. The PIDs killed besides slurmd."""
    marks = {f"SLURMD_NODENAME={node}".encode(), f"SLURM_CONF={cluster.env['SLURM_CONF']}".encode()}
    tasks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and marks <= set(_environ(p))]
    stepds = set()
    for pid in tasks:
        while True:
            try:
                pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                break
            if not cmdline(Path("/proc") / str(pid)).startswith("slurmstepd"):
                break
            stepds.add(pid)
    daemon = cluster.daemons[1 + NODES.index(node)]
    daemon.kill()
    daemon.wait()
    for pid in (*stepds, *tasks):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted({*stepds, *tasks})


def restart_node(cluster: Cluster, node: str, timeout: float = 180) -> None:
    """``node``'s slurmd started again after ``kill_node`` and the node back in service (idle)."""
    i = 1 + NODES.index(node)
    if cluster.daemons[i].poll() is None:
        return
    with open(cluster.dir / "log" / f"{node}.stdout", "a") as out:
        cluster.daemons[i] = subprocess.Popen(["slurmd", "-D", "-N", node], env=cluster.env, stdout=out,
                                              stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while cluster.run("sinfo", "-h", "-n", node, "-o", "%T").stdout.strip() != "idle":
        if time.time() > deadline:
            raise RuntimeError(f"{node} did not come back: " + cluster.run("sinfo", "-N").stdout)
        cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME")  # DOWN: back in service
        time.sleep(2)


def _stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop(cluster: Cluster) -> None:
    """Cancel what is left in the queue, then stop the daemons by PID."""
    if cluster.daemons and cluster.daemons[0].poll() is None:
        for partition in ("debug", "big", "all"):
            cluster.run("scancel", f"--partition={partition}")
        deadline = time.time() + 90
        while cluster.run("squeue", "-h").stdout.strip() and time.time() < deadline:
            time.sleep(1)
    for p in reversed(cluster.daemons):
        _stop_process(p)
    shutil.rmtree(cluster.ray_tmp, ignore_errors=True)


def cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def assert_cleaned_up(cluster: Cluster) -> None:
    """No process of the jobs' Ray is left (they all name its temp dir), no per-job folder, no Ray temp dir."""
    assert not list((REPO / "outputs" / "slurm").glob(f"{cluster.name}-*"))
    deadline = time.time() + 60
    while True:
        left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(cluster.ray_tmp) in cmdline(p)]
        if not left:
            break
        assert time.time() < deadline, f"Ray processes left: {[cmdline(p)[:200] for p in left]}"
        time.sleep(1)
    assert not list(cluster.ray_tmp.glob("mr-ray-*")), "a Ray temp dir was left on the node"


# --------------------------------------------------------------------------- the tiny 70B recipe on it

def tiny_raro(model: Path, tmp: Path, out: Path, *extra: str) -> list[str]:
    """Overrides that cut configs/raro_70b.yaml down to the tiny model on CPU: the e2e RARO test's settings,
    2 DP ranks (one per node), fp32 without the 70B recipe's memory settings and without its importance
    sampling (its weights read vLLM's log-probs, which vary in the last bits from run to run: the resumed
    run's losses could not equal the uninterrupted run's exactly), its KL term (the reference log-probs of
    both replicas are concatenated by the driver), 2 steps."""
    from test_train_e2e import _raro_args

    args = _raro_args(model, tmp, out, "trainer.steps=2", "parallel.tensor_model_parallel_size=1",
                      "parallel.pipeline_model_parallel_size=1", "parallel.data_parallel_size=2",
                      "rollout.tensor_parallel_size=1", "rollout.dtype=float32", "optim.warmup_steps=0",
                      "algorithm.kl_coef=0.001", "trainer.precision=fp32", "trainer.recompute=none",
                      "optim.use_distributed_optimizer=false", "parallel.sequence_parallel=false",
                      "algorithm.rollout_tis_cap=0", *extra)
    assert args[:4] == [sys.executable, "-m", "megareason.cli", "train"]
    return args[4:]


# Both nodes, no GPUs, one CPU each; a time limit well beyond the recipe's --signal lead (30 minutes).
SBATCH_ON_TWO_NODES = ("--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=90")


def sbatch(cluster: Cluster, name: str, *overrides: str, wait: bool = True) -> tuple[str, Path, subprocess.Popen]:
    """``sbatch slurm/raro_70b.sbatch OVERRIDES`` on both nodes: (job id, job log, the sbatch process, which
    with ``wait`` follows the job through its requeues and exits with its final code)."""
    log = cluster.dir / f"{name}.out"
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *SBATCH_ON_TWO_NODES, f"--job-name={name}",
           f"--output={log}", "slurm/raro_70b.sbatch", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    job = proc.stdout.readline().strip()
    assert job.isdigit(), proc.stderr.read()
    return job, log, proc


def read_log(log: Path) -> str:
    return log.read_text() if log.exists() else ""


def metrics(out: Path) -> dict[int, dict]:
    import json

    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def wait_for_text(log: Path, text: str, timeout: float, count: int = 1) -> float:
    """Until the job log holds ``text`` ``count`` times; the time it was seen (polled every 0.2 s)."""
    deadline = time.time() + timeout
    while read_log(log).count(text) < count:
        assert time.time() < deadline, f"{text!r} x {count} not in the job log:\n" + read_log(log)[-6000:]
        time.sleep(0.2)
    return time.time()


def wait_for_loop(out: Path, proc: subprocess.Popen | None, log: Path, runs: int = 1, timeout: float = 900) -> None:
    """Until the loop of the job's ``runs``-th run (1: the first, 2: the first requeued one) is in its first
    step. The Tracker opens a new tensorboard event file just before the loop, whose first iteration stops at
    once on a signal that came before it ("before step N: stopped", no checkpoint: seen once in CI); 2 s
    later the step is generating (a tiny RARO step takes 5 s or more here: two generate passes, log-probs,
    an update and a sync through Ray), so the stop comes after it, with a checkpoint."""
    deadline = time.time() + timeout
    while len(list((out / "tensorboard").glob("events.*"))) < runs:
        assert proc is None or proc.poll() is None, read_log(log)[-6000:]
        assert time.time() < deadline, read_log(log)[-6000:]
        time.sleep(0.2)
    time.sleep(2.0)
