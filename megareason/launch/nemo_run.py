"""NeMo-Run launchers for the recipes in configs/: ``megareason launch --executor local|slurm RECIPE``.

* **local** (``nemo_run.LocalExecutor``): runs ``python -m megareason.cli train --config-name RECIPE ...`` on
  this machine; the driver starts its own private Ray cluster.
* **slurm**: NeMo-Run's own Ray-on-Slurm path: a ``SlurmExecutor`` whose ``ray_template`` is
  ``templates/ray_cluster.sub.j2``, and a task marked ``use_with_ray_cluster``; NeMo-Run renders the job
  script (``SlurmRayRequest``: its ``#SBATCH`` lines and environment) and submits it with ``sbatch
  --requeue``. NeMo-Run's stock template (``ray.sub.j2``, NeMo-RL's ``ray.sub``) does not fit megareason:
  it hard-codes 8 GPUs and 128 CPUs per node, puts every node on the same ports 53001-54257 (inside the
  ephemeral range of common kernels and of some DGX nodes; two Slurm nodes on one host collide), always
  passes pyxis flags (no container-less run), forwards no time-limit signal and never requeues. Our
  template runs the sbatch recipes' own script instead, ``slurm/ray_cluster.sh`` (node check, Ray with
  per-job ports below the ephemeral range and a private token, checkpoint + requeue on SIGUSR1 or a
  pre-emption's SIGTERM, Ray's logs in the run folder), so both paths behave the same. The resources are
  the recipe's own ``#SBATCH`` lines (``slurm/RECIPE.sbatch``, else ``slurm/train.sbatch``) with the flags
  given here applied on top, and ``trainer.output_dir`` is made absolute (against the checkout, where
  the driver runs), so a requeued or relaunched job finds its checkpoints. ``--dry-run`` prints the
  job script without submitting anything.

NeMo-Run lives in its own environment (``launch_env``: it cannot be installed beside vLLM); ``megareason
launch`` from the main environment hands over to that environment's interpreter when it exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megareason.launch import launch_env

HELP = """\
Launch a recipe (a config in configs/) with NeMo-Run: --executor local runs the driver here;
--executor slurm submits the recipe's Slurm job (the #SBATCH lines of slurm/RECIPE.sbatch, the flags
below on top) through NeMo-Run's Ray-on-Slurm path, running slurm/ray_cluster.sh like `sbatch
slurm/RECIPE.sbatch` does; --dry-run prints that job script instead. NeMo-Run lives in its own
environment (.venv-launch; create it with `python -m megareason.launch.launch_env`), which this command
switches to.

examples:
  megareason launch --executor slurm --dry-run --container-image /images/megareason.sqsh raro_70b
  megareason launch --executor slurm --nodes 2 --gpus-per-node 8 grpo_smollm2_cpu trainer.steps=50
  megareason launch --executor local grpo_quickstart trainer.steps=2
"""

TEMPLATE = Path(__file__).resolve().parent / "templates" / "ray_cluster.sub.j2"
SLURM_DIR = launch_env.REPO / "slurm"
# Directives NeMo-Run sets itself (the job's name, its log file under --job-dir).
OWN_DIRECTIVES = {"job-name", "output", "error"}
# What the job script reads from the environment (slurm/ray_cluster.sh), written into the script when set
# here: the job then runs the same way after a requeue, or when submitted from elsewhere.
JOB_ENV = ("MEGAREASON_PYTHON", "MEGAREASON_RAY_PORT_BASE", "MEGAREASON_RAY_WORKERS_SOFT_LIMIT",
           "MEGAREASON_RAY_WAIT_S", "MEGAREASON_RAY_START_RETRIES", "MEGAREASON_RAY_TMPDIR",
           "MEGAREASON_RAY_START_ARGS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA")


@dataclass
class LaunchSpec:
    """What to launch and where. ``recipe`` is a config name in configs/ or a path to a YAML file. The Slurm
    resources left at None come from the recipe's ``#SBATCH`` lines."""

    recipe: str
    overrides: list[str] = field(default_factory=list)
    executor: str = "local"  # local | slurm
    command: str = "train"  # the megareason subcommand the job runs: train | eval (local only)
    python: str = ""  # the workers' interpreter; empty: the repo's .venv locally, the job's python3 on Slurm
    job_dir: str = "outputs/nemo_run"
    # Slurm
    nodes: int | None = None
    gpus_per_node: int | None = None  # 0: request no GPUs
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str = ""
    account: str = ""
    container_image: str = ""
    container_mounts: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the launcher's environment (JOB_ENV is taken from it)

    @property
    def name(self) -> str:
        return Path(self.recipe).stem


def _is_file(recipe: str) -> bool:
    return recipe.endswith((".yaml", ".yml")) or "/" in recipe


def recipe_sbatch(recipe: str) -> Path:
    """The recipe's own sbatch script, else the generic ``slurm/train.sbatch``."""
    own = SLURM_DIR / f"{Path(recipe).stem}.sbatch"
    return own if own.is_file() else SLURM_DIR / "train.sbatch"


def sbatch_directives(path: Path) -> dict[str, str | bool]:
    """``#SBATCH --key=value`` / ``#SBATCH --flag`` lines of a script, in order (``{"exclusive": True}``)."""
    out: dict[str, str | bool] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) if m.group(2) is not None else True
    return out


def slurm_directives(spec: LaunchSpec) -> dict[str, str | bool]:
    """The job's ``#SBATCH`` settings: the recipe's, then this launch's flags (NeMo-Run names the job and
    its log files)."""
    d = {k: v for k, v in sbatch_directives(recipe_sbatch(spec.recipe)).items() if k not in OWN_DIRECTIVES}
    for key, value in (("nodes", spec.nodes), ("gpus-per-node", spec.gpus_per_node),
                       ("cpus-per-task", spec.cpus_per_task), ("time", spec.time),
                       ("partition", spec.partition or None), ("account", spec.account or None)):
        if value is not None:
            d[key] = str(value)
    if d.get("gpus-per-node") == "0":
        del d["gpus-per-node"]
    return d


def run_dir(spec: LaunchSpec) -> Path:
    """The run folder (``trainer.output_dir``) as the job will see it: relative paths are relative to the
    checkout, where ``slurm/ray_cluster.sh`` runs the driver."""
    from megareason.config import load_config

    path = Path(spec.recipe)
    cfg = load_config(path.stem if _is_file(spec.recipe) else spec.recipe, spec.overrides,
                      path.parent if _is_file(spec.recipe) else None)
    out = Path(cfg.trainer.output_dir)
    return out if out.is_absolute() else (launch_env.REPO / out).resolve()


def job_body(spec: LaunchSpec) -> str:
    """The job script's body: the sbatch recipes' ``megareason_slurm_run`` with an absolute run folder."""
    recipe = str(Path(spec.recipe).resolve()) if _is_file(spec.recipe) else spec.recipe
    args = [recipe, *spec.overrides, f"trainer.output_dir={run_dir(spec)}"]
    return (f"source {shlex.quote(str(SLURM_DIR / 'ray_cluster.sh'))} || exit 1\n"
            f"megareason_slurm_run {' '.join(shlex.quote(a) for a in args)}\n")


def job_env(spec: LaunchSpec) -> dict[str, str]:
    """Environment written into the job script (values shell-quoted: NeMo-Run writes ``export K=V``)."""
    env = {k: spec.env[k] for k in JOB_ENV if spec.env.get(k)}
    env["MEGAREASON_ROOT"] = str(launch_env.REPO)
    if spec.python:
        env["MEGAREASON_PYTHON"] = spec.python
    if spec.container_image:
        env["MEGAREASON_CONTAINER_IMAGE"] = spec.container_image
    if spec.container_mounts:
        env["MEGAREASON_CONTAINER_MOUNTS"] = ",".join(spec.container_mounts)
    return {k: shlex.quote(v) for k, v in env.items()}


def driver_command(spec: LaunchSpec) -> str:
    """The local executor's command line (every argument quoted)."""
    python = spec.python or _local_python()
    path = Path(spec.recipe)
    args = [python, "-m", "megareason.cli", spec.command, "--config-name", path.stem]
    if _is_file(spec.recipe):
        args += ["--config-dir", str(path.resolve().parent)]
    return " ".join(shlex.quote(a) for a in [*args, *spec.overrides])


def _local_python() -> str:
    venv_python = launch_env.REPO / ".venv" / "bin" / "python"
    return os.environ.get("MEGAREASON_PYTHON") or (str(venv_python) if venv_python.is_file() else "python")


_INT_FLAGS = {"nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node"}


def build_executor(spec: LaunchSpec):
    import nemo_run as run

    if spec.executor == "local":
        return run.LocalExecutor()
    from nemo_run.core.execution.slurm import SlurmExecutor

    known = {f for f in SlurmExecutor.SBATCH_FLAGS} & set(SlurmExecutor.__dataclass_fields__)
    kwargs, extra = {}, {}
    for key, value in slurm_directives(spec).items():
        name = key.replace("-", "_")
        if name in known:
            kwargs[name] = int(value) if key in _INT_FLAGS else value
        else:
            extra[name] = value  # e.g. requeue: NeMo-Run writes #SBATCH --requeue (and submits with it)
    kwargs.setdefault("account", None)  # None: the cluster's default account
    job_dir = str(Path(spec.job_dir).resolve())
    executor = run.SlurmExecutor(
        **kwargs,
        additional_parameters=extra,
        job_name_prefix="megareason-",
        packager=run.Packager(),  # the shared file system (or the container) already holds megareason
        # Submit from this machine (a Slurm login node). NeMo-Run puts each experiment in
        # JOB_DIR/experiments/TITLE/ID (launch()'s base_dir) and sbatch reads the job script from there.
        tunnel=run.LocalTunnel(job_dir=os.path.join(job_dir, "experiments")),
        env_vars=job_env(spec),
        setup_lines=job_body(spec),
        ray_template=str(TEMPLATE),
    )
    # The job's log (#SBATCH --output, appended to across requeues): Slurm needs the folder to exist.
    executor.job_details.folder = os.path.join(job_dir, "logs")
    return executor


def launch(spec: LaunchSpec, dry_run: bool = False) -> int:
    """Submit (or with ``dry_run`` print) ``spec``. Returns 0 when the job was submitted, printed, or (local)
    succeeded."""
    import nemo_run as run
    from nemo_run.config import USE_WITH_RAY_CLUSTER_KEY

    executor = build_executor(spec)
    if spec.executor == "local":
        script = run.Script(inline=driver_command(spec) + "\n")
    else:  # the job script is the template's; NeMo-Run keeps this copy of its body with the experiment
        script = run.Script(inline=executor.setup_lines, metadata={USE_WITH_RAY_CLUSTER_KEY: True})
    with run.Experiment(spec.name, executor=executor, log_level="WARN",
                        base_dir=str(Path(spec.job_dir).resolve())) as exp:
        exp.add(script, executor=executor, name=spec.name)
        if dry_run:
            exp.dryrun(log=False)
            info = exp.jobs[0]._dryrun_info  # NeMo-Run 0.11 keeps the dry run's request here
            print(info.request.materialize() if spec.executor == "slurm" else script.inline)
            return 0
        if spec.executor == "slurm":
            os.makedirs(executor.job_details.folder, exist_ok=True)
        exp.run(sequential=True, detach=spec.executor == "slurm", tail_logs=spec.executor == "local")
    if spec.executor == "slurm":
        job = str(exp.jobs[0].handle).rsplit("/", 1)[-1]
        log = Path(executor.job_details.folder) / f"sbatch_{executor.job_name_prefix}{spec.name}_{job}.out"
        print(f"submitted {spec.name}: Slurm job {job}; run folder {run_dir(spec)}; job log {log}; "
              f"`squeue -j {job}`, `scancel {job}`")
        return 0
    state = str(exp.jobs[0].state)
    print(f"{spec.name}: {state}")
    return 0 if state.endswith("SUCCEEDED") else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a config name in configs/ (e.g. raro_70b) or a path to a YAML file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--executor", choices=["local", "slurm"], default="local")
    parser.add_argument("--dry-run", action="store_true", help="print the generated script, submit nothing")
    parser.add_argument("--run", dest="subcommand", choices=["train", "eval"], default="train",
                        help="the megareason subcommand the job runs (default: train; eval: local executor only)")
    parser.add_argument("--python", default="", help="the workers' Python (default: the repo's .venv locally, "
                        "python3 on Slurm, i.e. the container's)")
    parser.add_argument("--job-dir", default=LaunchSpec.job_dir, help="where NeMo-Run keeps job scripts and logs")
    s = parser.add_argument_group("slurm (default: the recipe's #SBATCH lines, slurm/RECIPE.sbatch or "
                                  "slurm/train.sbatch)")
    s.add_argument("--nodes", type=int, default=None)
    s.add_argument("--gpus-per-node", type=int, default=None, help="0: request no GPUs")
    s.add_argument("--cpus-per-task", type=int, default=None)
    s.add_argument("--time", default=None)
    s.add_argument("--partition", default="")
    s.add_argument("--account", default="")
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
    from megareason.config import ConfigError, load_config

    if args.executor == "slurm" and args.subcommand != "train":
        raise ConfigError(f"--run {args.subcommand}: the Slurm executor runs `megareason train` (its job brings "
                          f"up Ray for the trainer's workers); evaluate with --executor local")
    for flag in ("nodes", "cpus_per_task"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.gpus_per_node is not None and args.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    path = Path(args.recipe)
    load_config(path.stem if _is_file(args.recipe) else args.recipe, args.overrides,
                path.parent if _is_file(args.recipe) else None, training=args.subcommand == "train")
    spec = LaunchSpec(recipe=args.recipe, overrides=list(args.overrides), executor=args.executor,
                      command=args.subcommand, python=args.python, job_dir=args.job_dir, nodes=args.nodes,
                      gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
                      partition=args.partition, account=args.account, container_image=args.container_image,
                      container_mounts=[m for m in args.container_mounts.split(",") if m], env=dict(os.environ))
    return launch(spec, dry_run=args.dry_run)
