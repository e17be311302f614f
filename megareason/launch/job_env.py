"""Where a job step writes: every cache and temporary folder of the stack under the job's scratch.

A container started the way sites start one (enroot's defaults, pyxis' ``--no-container-mount-home``) has a
read-only root and no writable home, so each library's home-relative or ``/tmp`` default fails: vLLM's
compilation backend ``os.makedirs(~/.cache/vllm/...)``, torch inductor's ``/tmp/torchinductor_USER``, Triton's
``~/.triton/cache``, matplotlib's ``~/.config/matplotlib``, Python's ``tempfile``. ``step_environment`` is the
one place that points each of them (the variable the library itself reads, listed in ``SCRATCH_VARS``) at a
folder of the job's node-local scratch. ``slurm/ray_cluster.sh`` runs every job step through this module
(``python -m megareason.launch.job_env ... -- COMMAND``), so the node check, the driver and each node's Ray,
whose workers and vLLM engines inherit the raylet's environment, all see the same settings.

A variable the site already set is kept where it can be written (a shared Triton cache, a node-local
``TMPDIR``); Slurm sets ``TMPDIR`` in every step (``/tmp`` unless ``TmpFS`` says otherwise), which a read-only
container cannot write, so a value that cannot be written is replaced like an unset one. The two
model stores, Hugging Face's (``HF_HOME``) and megareason's converted models (``MEGAREASON_CACHE``), hold data
a run reads, not only a cache: they stay in the home folder where it is writable (a plain node: the models the
user fetched there) and go to the scratch where it is not (a container without a home): set them to shared
storage to keep downloads across jobs. A home that cannot be written is replaced by a folder of the scratch
(``HOME``), for whatever else writes under ``~``.

``python -m megareason.launch.job_env [--scratch DIR] [--ephemeral] -- COMMAND...`` creates the folders, sets
the variables and runs COMMAND. In a job step DIR is the node's own folder of the job (``node_scratch``): Ray's
temp dir on that node, which ``ray_node.py`` removes when Ray stops; ``--ephemeral``: a folder of this step
alone, removed after COMMAND (the steps before Ray starts).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

# variable -> folder under the scratch; each read by the library named, in place of a home or /tmp default.
SCRATCH_VARS = {
    "TMPDIR": "tmp",  # Python's tempfile; vLLM's RPC sockets (envs.py VLLM_RPC_BASE_PATH), inductor's default
    "XDG_CACHE_HOME": "cache",  # the default root of vLLM's, torch's (hub, extensions) and pip's caches
    "XDG_CONFIG_HOME": "config",  # the default root of vLLM's config folder (envs.py get_default_config_root)
    "VLLM_CACHE_ROOT": "cache/vllm",  # vLLM's compile cache (vllm/envs.py VLLM_CACHE_ROOT, ~/.cache/vllm)
    "VLLM_CONFIG_ROOT": "config/vllm",  # vllm/envs.py VLLM_CONFIG_ROOT (~/.config/vllm)
    "TORCHINDUCTOR_CACHE_DIR": "cache/torchinductor",  # torch/_inductor/runtime/cache_dir_utils.py cache_dir()
    "TRITON_HOME": "triton",  # Triton's base for its cache, dump and override folders (~/.triton)
    "TRITON_CACHE_DIR": "triton/cache",  # read by Triton and by inductor's triton_cache_dir()
    "CUDA_CACHE_PATH": "cache/nv",  # the CUDA driver's JIT cache (~/.nv/ComputeCache)
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # FlashInfer's JIT workspace (flashinfer/jit/env.py; default ~)
    "MPLCONFIGDIR": "config/matplotlib",  # matplotlib's config and font cache (~/.config/matplotlib)
    "WANDB_CACHE_DIR": "cache/wandb",  # wandb's artifact cache (~/.cache/wandb)
    "WANDB_DATA_DIR": "wandb",  # wandb's staging folder (~/.local/share/wandb)
}
# Model stores: the home folder's when writable (module docstring), else the scratch's.
MODEL_STORES = {"HF_HOME": (".cache/huggingface", "huggingface"),
                "MEGAREASON_CACHE": (".cache/megareason", "megareason")}


def writable(path: Path) -> bool:
    """Whether ``path``, or the nearest folder above it that exists, can be written (a read-only mount: no)."""
    for p in (path, *path.parents):
        if p.exists():
            return p.is_dir() and os.access(p, os.W_OK)
    return False


def step_environment(scratch: Path, environ: dict[str, str]) -> dict[str, str]:
    """The variables to set for a job step whose node-local scratch folder is ``scratch``: each of
    ``SCRATCH_VARS`` that ``environ`` does not set to a folder that can be written, and each of
    ``MODEL_STORES`` it does not set (module docstring)."""
    out = {k: str(scratch / sub) for k, sub in SCRATCH_VARS.items()
           if not (environ.get(k) and writable(Path(environ[k])))}
    home = Path(environ.get("HOME") or "/nonexistent")
    for k, (under_home, sub) in MODEL_STORES.items():
        if not environ.get(k) and not writable(home / under_home):
            out[k] = str(scratch / sub)
    if not writable(home):  # what else writes under ~ (Path.home(), expanduser) writes to the scratch
        out["HOME"] = str(scratch / "home")
    return out


def apply(scratch: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` (or ``environ``) with ``step_environment`` set and its folders created; returns what
    was set."""
    environ = os.environ if environ is None else environ
    env = step_environment(scratch, dict(environ))
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    environ.update(env)
    return env


def node_scratch(environ: dict[str, str], ephemeral: bool = False) -> Path:
    """This node's folder of the job under ``MR_RAY_TMPDIR`` (slurm/ray_cluster.sh): ``mr-ray-JOB-K``, K the
    node's place in the job's node list, the folder its Ray node uses as temp dir; ``ephemeral``:
    ``mr-step-JOB.STEP-K``, the step's own."""
    nodes, node = environ.get("MR_NODES", "").split(), environ.get("SLURMD_NODENAME", "")
    if node not in nodes:
        raise ValueError(f"node {node!r} is not in the job's node list MR_NODES={environ.get('MR_NODES', '')!r}")
    job, k = environ["SLURM_JOB_ID"], nodes.index(node)
    name = f"mr-step-{job}.{environ.get('SLURM_STEP_ID', '0')}-{k}" if ephemeral else f"mr-ray-{job}-{k}"
    return Path(environ["MR_RAY_TMPDIR"]) / name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megareason.launch.job_env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scratch", type=Path, default=None,
                   help="the step's folder on the node's scratch (default: node_scratch's, from the job's environment)")
    p.add_argument("--ephemeral", action="store_true", help="remove the folder after the command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given after --")
    scratch = args.scratch or node_scratch(dict(os.environ), args.ephemeral)
    try:
        apply(scratch)
    except OSError as e:
        print(f"error: the job's scratch folder {scratch} cannot be created ({e.strerror}): set "
              f"MEGAREASON_RAY_TMPDIR to a writable node-local folder (mounted into the container)", file=sys.stderr)
        return 1
    if not args.ephemeral:
        os.execvp(command[0], command)
    try:
        return subprocess.call(command)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
