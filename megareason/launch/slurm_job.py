"""Steps of a Slurm job that ``slurm/ray_cluster.sh`` runs with the job's Python (in the container).

* ``run-dir [--config-dir DIR] --config-name NAME [KEY=VALUE ...]``: load and validate the training config
  exactly as ``megareason train`` will (same arguments, same working directory, its model found) and print
  its run folder (``trainer.output_dir``) as an absolute path. A bad config, override or model path fails
  here, naming the field (exit code 2), before Ray starts; the job keeps the folder for the Ray logs of
  each restart.
* ``wait ADDRESS NODES GPUS SECONDS``: wait until the Ray cluster at ADDRESS reports NODES alive nodes and
  GPUS GPUs, or fail after SECONDS saying what is missing.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path


def run_dir(argv: list[str]) -> int:
    from megareason.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="slurm_job run-dir")
    p.add_argument("--config-name", required=True)
    p.add_argument("--config-dir", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from megareason.models.hub import resolve_model_path

    try:
        cfg = load_config(args.config_name, args.overrides, args.config_dir, training=True)
        resolve_model_path(cfg.model.path)  # the driver's first check too
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(cfg.trainer.output_dir).resolve())
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
    print("usage: python -m megareason.launch.slurm_job run-dir --config-name NAME [KEY=VALUE ...] | "
          "wait ADDRESS NODES GPUS SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
