"""Steps of a Slurm job that ``slurm/ray_cluster.sh`` runs with the job's Python (in the container).

* ``run-dir [--hosts N --checkout DIR] [--config-dir DIR] --config-name NAME [KEY=VALUE ...]``: load and
  validate the training config exactly as ``megareason train`` will (same arguments, same working
  directory), run its preflight (``launch/preflight.py``: the model, the data files, the run folder and the
  free space for its checkpoints) and print its run folder (``trainer.output_dir``) as an absolute path. A
  bad config, override, model or data path, or a file system without room fails here, naming the field
  (exit code 2), before Ray starts; so does a run folder inside the checkout DIR on a job across N > 1
  hosts (``outside_checkout``). The job keeps the folder for the Ray logs of each restart.
* ``wait ADDRESS NODES GPUS SECONDS``: wait until the Ray cluster at ADDRESS reports NODES alive nodes and
  GPUS GPUs, or fail after SECONDS saying what is missing.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path


def outside_checkout(run: Path, checkout: Path, hosts: int) -> None:
    """A job across more than one host writes its run folder outside the checkout: the checkout is where the
    code is, often a home directory whose quota a large model's first checkpoint fills (hundreds of GB to a
    TB), and a quota is what the free-space check cannot see. ``ValueError`` naming both folders otherwise.
    A job on one host (one node, or a test cluster's nodes on one machine) may keep its run inside."""
    run, checkout = run.resolve(), checkout.resolve()
    if hosts > 1 and run.is_relative_to(checkout):
        raise ValueError(f"the run folder {run} (trainer.output_dir) lies inside the checkout {checkout}, on a job "
                         f"across {hosts} hosts: its checkpoints belong on a scratch file system, not where the "
                         f"code is (a home quota fills at the first save); set trainer.output_dir to a folder "
                         f"there, e.g. trainer.output_dir=/scratch/$USER/RUN")


def run_dir(argv: list[str]) -> int:
    from megareason.config import load_config

    p = argparse.ArgumentParser(prog="slurm_job run-dir")
    p.add_argument("--config-name", required=True)
    p.add_argument("--config-dir", default=None)
    p.add_argument("--hosts", type=int, default=1, help="distinct hosts among the job's nodes")
    p.add_argument("--checkout", default="", help="the megareason checkout the job runs from")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from megareason.launch.preflight import check_run

    try:
        cfg = load_config(args.config_name, args.overrides, args.config_dir, training=True)
        run = Path(cfg.trainer.output_dir).resolve()
        if args.checkout:
            outside_checkout(run, Path(args.checkout), args.hosts)
        check_run(cfg, "train")  # the driver's own preflight
    except (FileNotFoundError, ValueError) as e:  # ConfigError and PreflightError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(run)
    return 0


def wait(address: str, nodes: int, gpus: int, seconds: float) -> int:
    deadline = time.time() + seconds
    host, port = address.rsplit(":", 1)
    while True:  # ray.init retries forever while the head is not up: wait for its port first
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            break
        except OSError:
            if time.time() > deadline:
                print(f"no Ray head answers at {address} after {seconds:g} s", file=sys.stderr)
                return 1
            time.sleep(2)
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        have, cpus = (sum(n["Resources"].get(r, 0) for n in alive) for r in ("GPU", "CPU"))
        if len(alive) >= nodes and have >= gpus:
            print(f"megareason-slurm: Ray is up: {len(alive)} nodes, {have:g} GPUs, {cpus:g} CPUs", flush=True)
            return 0
        if time.time() > deadline:
            print(f"Ray has {len(alive)} of {nodes} nodes and {have:g} of {gpus} GPUs after {seconds:g} s",
                  file=sys.stderr)
            return 1
        time.sleep(2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run-dir"]:
        return run_dir(argv[1:])
    if argv[:1] == ["wait"] and len(argv) == 5:
        return wait(argv[1], int(argv[2]), int(argv[3]), float(argv[4]))
    print("usage: python -m megareason.launch.slurm_job run-dir [--hosts N --checkout DIR] --config-name NAME "
          "[KEY=VALUE ...] | wait ADDRESS NODES GPUS SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
