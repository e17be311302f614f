"""NeMo-Run launchers for the recipes in configs/: ``megareason launch --executor local|slurm RECIPE``.

* **local** (``nemo_run.LocalExecutor``): runs ``python -m megareason.cli train --config-name RECIPE ...`` on
  this machine; the driver starts its own private Ray cluster.
* **slurm** (``nemo_run.SlurmExecutor``): one task per node, in the container (pyxis ``--container-image`` /
  ``--container-mounts``) when one is given. Every task runs :data:`RAY_NODE_SCRIPT`: the first node starts
  the Ray head, waits until every node has joined, runs the same driver command with
  ``trainer.ray_address`` pointing at the head, stops Ray and exits with the driver's exit code; the other
  nodes join the head and leave when it is gone. ``--dry-run`` prints the generated sbatch script and
  the per-node script without submitting anything.

NeMo-Run lives in its own environment (``launch_env``: it cannot be installed beside vLLM); ``megareason
launch`` from the main environment hands over to that environment's interpreter when it exists.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megareason.launch import launch_env

HELP = """\
Launch a recipe (a config in configs/) with NeMo-Run: --executor local runs the driver here;
--executor slurm submits one task per node (Ray head + workers, pyxis container) and --dry-run prints the
sbatch script instead. NeMo-Run lives in its own environment (.venv-launch; create it with
`python -m megareason.launch.launch_env`), which this command switches to.

examples:
  megareason launch --executor slurm --dry-run --nodes 8 --container-image /images/megareason.sqsh raro_70b
  megareason launch --executor local grpo_quickstart trainer.steps=2
"""

# Runs on every node of the allocation (one Slurm task per node). Placeholders: {port}, {python},
# {timeout}, {command}. Ray is stopped by ending the `ray start --block` process this script started,
# never by `ray stop` (which stops every Ray on the node). Workers leave, exit 0, once the head's port
# closes, well within srun's --wait=60 grace after the head's task ends, so the driver's exit code is the
# job's.
RAY_NODE_SCRIPT = """\
set -uo pipefail
head_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_ip=$(getent ahostsv4 "$head_host" | awk 'NR == 1 {{print $1}}')
head_ip=${{head_ip:-$head_host}}
head="$head_ip:{port}"
nodes=${{SLURM_JOB_NUM_NODES:-${{SLURM_NNODES:-1}}}}
ray_args=(--block --disable-usage-stats --temp-dir="/tmp/mr-ray-${{SLURM_JOB_ID:-0}}-${{SLURM_NODEID:-0}}")
head_open() {{ (exec 3<>"/dev/tcp/$head_ip/{port}") 2>/dev/null; }}
deadline=$((SECONDS + {timeout}))
if [ "${{SLURM_NODEID:-0}}" = 0 ]; then
    ray start --head --node-ip-address="$head_ip" --port={port} --include-dashboard=false "${{ray_args[@]}}" &
    ray_pid=$!
    until [ "$({python} -c "import ray; ray.init(address='$head', logging_level='ERROR'); \\
print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null | tail -n 1)" = "$nodes" ]; do
        if [ $SECONDS -ge $deadline ] || ! kill -0 $ray_pid 2>/dev/null; then
            echo "error: $nodes Ray nodes did not join $head within {timeout} s" >&2
            kill $ray_pid 2>/dev/null; wait $ray_pid; exit 1
        fi
        sleep 5
    done
    echo "Ray cluster at $head has $nodes nodes"
    {command} "trainer.ray_address=$head"
    rc=$?
    kill $ray_pid; wait $ray_pid
    exit $rc
else
    until head_open; do
        if [ $SECONDS -ge $deadline ]; then echo "error: no Ray head at $head" >&2; exit 1; fi
        sleep 5
    done
    ray start --address="$head" "${{ray_args[@]}}" &
    ray_pid=$!
    while kill -0 $ray_pid 2>/dev/null && head_open; do sleep 5; done
    kill $ray_pid 2>/dev/null; wait $ray_pid
    exit 0
fi
"""
# A private Ray auth token per job, made when the batch script runs (NeMo-Run writes executor env_vars
# as unquoted `export KEY=VALUE` lines in the sbatch script) and inherited by every srun task.
RAY_AUTH_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')"}


@dataclass
class LaunchSpec:
    """What to launch and where. ``recipe`` is a config name in configs/ or a path to a YAML file."""

    recipe: str
    overrides: list[str] = field(default_factory=list)
    executor: str = "local"  # local | slurm
    command: str = "train"  # the megareason subcommand the job runs: train | eval
    python: str = ""  # the workers' interpreter; empty: the repo's .venv locally, "python" on Slurm
    job_dir: str = "outputs/nemo_run"
    # Slurm
    nodes: int = 1
    gpus_per_node: int = 8
    partition: str = ""
    account: str = ""
    time: str = "04:00:00"
    container_image: str = ""
    container_mounts: list[str] = field(default_factory=list)
    ray_port: int = 6379
    ray_timeout_s: int = 600

    @property
    def name(self) -> str:
        return Path(self.recipe).stem


def driver_command(spec: LaunchSpec) -> str:
    """The shell command line of the megareason driver for ``spec`` (every argument quoted)."""
    python = spec.python or ("python" if spec.executor == "slurm" else _local_python())
    path = Path(spec.recipe)
    args = [python, "-m", "megareason.cli", spec.command, "--config-name", path.stem]
    if path.suffix in (".yaml", ".yml") or "/" in spec.recipe:
        args += ["--config-dir", str(path.resolve().parent)]
    return " ".join(shlex.quote(a) for a in [*args, *spec.overrides])


def job_script(spec: LaunchSpec) -> str:
    """The script each task runs: the driver itself locally, the Ray bootstrap around it on Slurm."""
    command = driver_command(spec)
    if spec.executor == "local":
        return command + "\n"
    return RAY_NODE_SCRIPT.format(port=spec.ray_port, python=shlex.quote(spec.python or "python"),
                                  timeout=spec.ray_timeout_s, command=command)


def _local_python() -> str:
    venv_python = launch_env.REPO / ".venv" / "bin" / "python"
    return os.environ.get("MEGAREASON_PYTHON") or (str(venv_python) if venv_python.is_file() else "python")


def build_executor(spec: LaunchSpec):
    import nemo_run as run

    if spec.executor == "local":
        return run.LocalExecutor()
    job_dir = str(Path(spec.job_dir).resolve())
    return run.SlurmExecutor(
        account=spec.account or None,  # None: the cluster's default account
        job_name_prefix="megareason-",
        partition=spec.partition or None,
        nodes=spec.nodes,
        ntasks_per_node=1,  # one task per node: the Ray head or a Ray worker, which use every GPU
        gpus_per_node=spec.gpus_per_node or None,
        time=spec.time,
        container_image=spec.container_image or None,
        container_mounts=list(spec.container_mounts),
        packager=run.Packager(),  # the container (or the shared file system) already holds megareason
        tunnel=run.LocalTunnel(job_dir=job_dir),  # submit from this machine (a Slurm login node)
        env_vars=dict(RAY_AUTH_ENV),
    )


def launch(spec: LaunchSpec, dry_run: bool = False) -> int:
    """Submit (or with ``dry_run`` print) ``spec``. Returns 0 when the job succeeded (or was printed)."""
    import nemo_run as run

    script = run.Script(inline=job_script(spec))
    executor = build_executor(spec)
    with run.Experiment(spec.name, executor=executor, log_level="WARN") as exp:
        exp.add(script, executor=executor, name=spec.name)
        if dry_run:
            exp.dryrun(log=False)
            info = exp.jobs[0]._dryrun_info  # NeMo-Run 0.11 keeps the dry run's request here
            print(info if info is not None else f"# {spec.executor} executor: runs the script below")
            print(f"\n#----------------\n# job script (runs on every node as {spec.name}.sh)\n#----------------")
            print(script.inline)
            return 0
        exp.run(sequential=True, detach=spec.executor == "slurm", tail_logs=spec.executor == "local")
    if spec.executor == "slurm":
        print(f"submitted {spec.name}: {exp._id} (nemo experiment status {exp._id})")
        return 0
    state = str(exp.jobs[0].state)
    print(f"{spec.name}: {state}")
    return 0 if state.endswith("SUCCEEDED") else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a config name in configs/ (e.g. raro_70b) or a path to a YAML file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--executor", choices=["local", "slurm"], default="local")
    parser.add_argument("--dry-run", action="store_true", help="print the generated script(s), submit nothing")
    parser.add_argument("--run", dest="subcommand", choices=["train", "eval"], default="train",
                        help="the megareason subcommand the job runs (default: train)")
    parser.add_argument("--python", default="", help="the workers' Python (default: the repo's .venv locally, "
                        "'python' on Slurm, i.e. the container's)")
    parser.add_argument("--job-dir", default=LaunchSpec.job_dir, help="where NeMo-Run keeps job scripts and logs")
    s = parser.add_argument_group("slurm")
    s.add_argument("--nodes", type=int, default=LaunchSpec.nodes)
    s.add_argument("--gpus-per-node", type=int, default=LaunchSpec.gpus_per_node, help="0: request no GPUs")
    s.add_argument("--partition", default="")
    s.add_argument("--account", default="")
    s.add_argument("--time", default=LaunchSpec.time)
    s.add_argument("--container-image", default=os.environ.get("MEGAREASON_CONTAINER_IMAGE", ""),
                   help="pyxis image (a .sqsh file or registry reference; default $MEGAREASON_CONTAINER_IMAGE); "
                   "empty: no container")
    s.add_argument("--container-mounts", default=os.environ.get("MEGAREASON_CONTAINER_MOUNTS", ""),
                   help="comma-separated SRC:DST mounts (default $MEGAREASON_CONTAINER_MOUNTS)")


def run_cli(args: argparse.Namespace, argv: list[str]) -> int:
    """``megareason launch``: validate the recipe, then launch it with NeMo-Run (re-executing in the
    launcher environment when nemo_run is not importable here)."""
    try:
        import nemo_run  # noqa: F401
    except ImportError:
        python = launch_env.python_path()
        if python.is_file() and Path(sys.prefix).resolve() != launch_env.venv_dir().resolve():
            os.execv(python, [str(python), "-m", "megareason.cli", *argv])
        print(f"error: nemo-run is not installed here (it cannot share an environment with vLLM). Create the "
              f"launcher environment with `{sys.executable} -m megareason.launch.launch_env` "
              f"({launch_env.venv_dir()}), then run this command again.", file=sys.stderr)
        return 2
    from megareason.config import load_config, validate_training

    path = Path(args.recipe)
    is_file = path.suffix in (".yaml", ".yml") or "/" in args.recipe
    cfg = load_config(path.stem, args.overrides, path.parent if is_file else None)
    if args.subcommand == "train":
        validate_training(cfg)
    spec = LaunchSpec(recipe=args.recipe, overrides=list(args.overrides), executor=args.executor,
                      command=args.subcommand, python=args.python, job_dir=args.job_dir, nodes=args.nodes,
                      gpus_per_node=args.gpus_per_node, partition=args.partition, account=args.account,
                      time=args.time, container_image=args.container_image,
                      container_mounts=[m for m in args.container_mounts.split(",") if m])
    return launch(spec, dry_run=args.dry_run)
