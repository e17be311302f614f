"""One Ray node of a Slurm job, kept alive through a pre-emption's SIGTERM until the job says stop.

``python -m megareason.launch.ray_node --job-dir DIR --temp-dir TMP [--retries N] -- RAY_START_ARGS...``
runs ``ray start --block --temp-dir=TMP RAY_START_ARGS`` inside a Slurm step (``slurm/ray_cluster.sh``) and:

* **survives SIGTERM**: a pre-emption (or ``scancel --signal=TERM``) signals every process of every job step
  at once. ``ray start``, the GCS, the raylet and its workers would all exit, and the driver, which
  finishes its step and checkpoints on that same SIGTERM, would lose its actors. So Ray runs with SIGTERM
  *blocked* (a blocked signal stays pending: the C++ handlers of the GCS and raylet never run; the mask is
  inherited through fork and exec by every process Ray starts, as Ray itself does for SIGINT), and this
  supervisor only logs the signal. Slurm's SIGKILL at the end of the grace time still ends everything.
* **stops Ray when the job script says so**: the file ``DIR/ray.stop`` appears (the job script writes it
  after the driver exited). The supervisor then SIGKILLs the whole process tree of ``ray start`` (Ray's
  agents would otherwise outlive a killed raylet), copies this node's Ray logs into the run folder
  (``RUN/ray_logs/restart_R/NODE/``, ``RUN`` read from ``DIR/run_dir``, ``R`` = ``$SLURM_RESTART_COUNT``)
  and removes its temp dir (node-local disk).
* **retries ``ray start``** while the cluster is not up yet (no ``DIR/ray.up``): a worker that came before
  its head, a port still held by a previous run; ``--retries`` times, ``--retry-delay`` seconds apart, as
  NeMo-RL's ``ray.sub`` does. Once the cluster is up, a Ray node that dies ends the step with its code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from megareason.logs import NODE_HOOK_ENV
from megareason.utils import proc_stat, process_table

STOP_FILE, UP_FILE, RUN_DIR_FILE = "ray.stop", "ray.up", "run_dir"
POLL_S = 1.0


def log(message: str) -> None:
    node = os.environ.get("SLURMD_NODENAME", "")
    print(f"{time.strftime('%H:%M:%S')} megareason-ray-node {node}: {message}", flush=True)


# Ray runs this module:function in every worker process it starts (Ray's own worker_process_setup_hook
# mechanism: default_worker.py reads the variable from the environment the raylet passes on).
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
SETUP_HOOK = "megareason.launch.ray_node.shield_worker"


def start_shielded(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` with SIGTERM blocked in it and everything it starts (this process keeps it unblocked), and
    ``shield_worker`` run in each Ray worker."""
    hook = os.environ.get(SETUP_HOOK_ENV, SETUP_HOOK)
    # NODE_HOOK_ENV: the driver's runtime_env sets a setup hook of its own (megareason.logs), which runs this one.
    env = {**os.environ, SETUP_HOOK_ENV: hook, NODE_HOOK_ENV: hook}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return subprocess.Popen(cmd, env=env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def shield_worker() -> None:
    """In a Ray worker (the actors, and the vLLM engines they start): keep SIGTERM away for good. The
    worker inherited it blocked, but Python's multiprocessing unblocks it in the calling thread when it
    starts its resource tracker (``resource_tracker.ensure_running``: block, spawn, *unblock*), which
    vLLM's engines trigger; Ray's own handler would then end the actor. So: start the tracker now, block
    SIGTERM again (threads and processes started later inherit it) and ignore it."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (children first found, then theirs)."""
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in process_table().items():
        children.setdefault(ppid, []).append(p)
    tree, queue = [], [pid]
    while queue:
        p = queue.pop(0)
        tree.append(p)
        queue += children.get(p, [])
    return tree


def kill_tree(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL ``proc`` and every descendant (collected first: they are re-parented once it dies)."""
    pids = process_tree(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + timeout
    while any((st := proc_stat(p)) is not None and st[1] != psutil.STATUS_ZOMBIE for p in pids[1:]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)


def keep_logs(temp_dir: Path, job_dir: Path) -> Path | None:
    """Copy this node's Ray session logs to ``RUN/ray_logs/restart_R/NODE`` (RUN from ``job_dir/run_dir``)."""
    run_file = job_dir / RUN_DIR_FILE
    logs = temp_dir / "session_latest" / "logs"
    if not run_file.is_file() or not logs.is_dir():
        return None
    node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    dest = Path(run_file.read_text().strip()) / "ray_logs" / f"restart_{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    dest /= node
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(logs, tmp, symlinks=True, ignore_dangling_symlinks=True,
                    ignore=shutil.ignore_patterns("*.sock", "sockets"))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)  # the folder appears complete or not at all
    return dest


def ray_start_command(temp_dir: Path, ray_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--temp-dir={temp_dir}", *ray_args]


def run(cmd: list[str], job_dir: Path, temp_dir: Path, retries: int, retry_delay: float) -> int:
    """Supervise ``cmd`` (``ray start --block ...`` with ``temp_dir``) as described in the module docstring;
    returns the step's exit code."""
    terms = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(time.monotonic()))
    attempt, proc, logged = 0, start_shielded(cmd), 0
    try:
        while True:
            if len(terms) > logged:
                logged = len(terms)
                log("SIGTERM (a pre-emption or scancel): Ray keeps running so that the driver can finish its step "
                    "and checkpoint; it stops when the job script says so, or at Slurm's SIGKILL")
            if (job_dir / STOP_FILE).exists():
                kill_tree(proc)
                try:
                    kept = keep_logs(temp_dir, job_dir)
                    log(f"Ray stopped; its logs are in {kept}" if kept else "Ray stopped")
                finally:
                    shutil.rmtree(temp_dir, ignore_errors=True)
                return 0
            rc = proc.poll()
            if rc is not None:
                if (job_dir / UP_FILE).exists() or attempt >= retries:
                    log(f"ray start exited with {rc}" + ("" if (job_dir / UP_FILE).exists() else
                                                         f" after {attempt + 1} attempt(s)"))
                    return rc or 1
                attempt += 1
                log(f"ray start exited with {rc}; attempt {attempt + 1} of {retries + 1} in {retry_delay:g} s")
                kill_tree(proc)  # what a failed start left behind
                time.sleep(retry_delay)
                proc = start_shielded(cmd)
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        signal.signal(signal.SIGTERM, previous)


def settings(ray_args: list[str], env: dict[str, str]) -> str:
    """What this node's Ray starts with, as the job log shows it: the CPUs Ray schedules on, its worker
    port range, the first port of megareason's services on the node, the idle-worker limit and whether
    workers are prestarted (each worker holds a port of the range: a node with many CPUs must not start
    one per CPU)."""
    flags = dict(a[2:].split("=", 1) for a in ray_args if a.startswith("--") and "=" in a)
    prestart = "on" if env.get("RAY_enable_worker_prestart", "1") not in ("0", "false") else "off"
    return (f"ray start: {flags.get('num-cpus', 'all')} CPUs, worker ports {flags.get('min-worker-port', '?')}-"
            f"{flags.get('max-worker-port', '?')}, services from port {env.get('MEGAREASON_PORT_BASE', '?')}, "
            f"idle workers <= {env.get('RAY_num_workers_soft_limit', 'one per CPU')}, worker prestart {prestart}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megareason.launch.ray_node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job-dir", type=Path, required=True, help="the job's folder on the shared file system")
    p.add_argument("--temp-dir", type=Path, required=True, help="this node's Ray temp dir (node-local disk)")
    p.add_argument("--retries", type=int, default=3, help="more `ray start` attempts before the cluster is up")
    p.add_argument("--retry-delay", type=float, default=5.0, help="seconds between attempts")
    p.add_argument("ray_args", nargs=argparse.REMAINDER, help="-- then the `ray start` arguments")
    args = p.parse_args(argv)
    ray_args = args.ray_args[1:] if args.ray_args[:1] == ["--"] else args.ray_args
    if args.retries < 0:
        p.error(f"--retries must be >= 0, got {args.retries}")
    log(settings(ray_args, os.environ))
    return run(ray_start_command(args.temp_dir, ray_args), args.job_dir, args.temp_dir, args.retries, args.retry_delay)


if __name__ == "__main__":
    raise SystemExit(main())
