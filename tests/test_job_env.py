"""Where a job step writes (megareason/launch/job_env.py): each library's own resolution of its cache and
temporary folders, asked in a fresh process with the step's environment, lands under the job's scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megareason.launch.job_env import node_scratch, step_environment

REPO = Path(__file__).resolve().parents[1]

# Each library's own answer to "where do you write", with the environment it was started with.
RESOLVED = """\
import json, tempfile
temp = tempfile.gettempdir()
import huggingface_hub.constants as hf
import matplotlib
import importlib.machinery, importlib.util, os
# vllm/envs.py itself (stdlib only), without importing vllm (20 s here)
vllm_dir = importlib.machinery.PathFinder.find_spec("vllm").submodule_search_locations[0]
spec = importlib.util.spec_from_file_location("vllm_envs", os.path.join(vllm_dir, "envs.py"))
vllm_envs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_envs)
from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir
from megareason.models.hub import cache_dir as models
from pathlib import Path
print(json.dumps({"tempfile": temp, "vllm cache": vllm_envs.VLLM_CACHE_ROOT,
                  "vllm config": vllm_envs.VLLM_CONFIG_ROOT, "vllm rpc": vllm_envs.VLLM_RPC_BASE_PATH,
                  "inductor": cache_dir(), "triton (inductor)": triton_cache_dir(0),
                  "matplotlib": matplotlib.get_configdir(), "huggingface": hf.HF_HOME,
                  "megareason models": str(models()), "home": str(Path.home())}))
"""


def _sandboxed(bwrap: str, scratch: Path, *command: str) -> subprocess.CompletedProcess:
    """``command`` as enroot runs a container with its defaults (tests/slurm_cluster.py's sandbox): everything
    read-only but ``scratch``, no home."""
    scratch.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "HF_HUB_OFFLINE")}
    return subprocess.run([bwrap, "--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--proc", "/proc",
                           "--bind", str(scratch), str(scratch), "--clearenv", "--die-with-parent",
                           # Slurm sets TMPDIR (TmpFS, /tmp) in every step
                           *(a for k, v in {**keep, "HOME": "/nonexistent/home", "TMPDIR": "/tmp"}.items()
                             for a in ("--setenv", k, v)),
                           "--", *command], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_every_cache_of_the_stack_resolves_under_the_scratch_in_a_read_only_container_without_a_home(
        bubblewrap, tmp_path):
    scratch = tmp_path / "scratch"
    proc = _sandboxed(bubblewrap, scratch, sys.executable, "-m", "megareason.launch.job_env", "--scratch",
                      str(scratch / "step"), "--", sys.executable, "-c", RESOLVED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads(proc.stdout.splitlines()[-1])
    outside = {k: v for k, v in resolved.items() if not Path(v).is_relative_to(scratch / "step")}
    assert not outside, outside
    assert resolved["home"] == str(scratch / "step" / "home") and resolved["tempfile"] == str(scratch / "step" / "tmp")
    # Without it the first library that asks for a temporary folder fails (vLLM's RPC path, the first here).
    proc = _sandboxed(bubblewrap, scratch, sys.executable, "-c", RESOLVED)
    assert proc.returncode != 0 and "No usable temporary directory found" in proc.stderr, proc.stderr[-3000:]


def test_a_writable_home_keeps_the_model_stores_and_the_sites_own_settings_are_kept(tmp_path):
    home, scratch = tmp_path / "home", tmp_path / "scratch"
    home.mkdir()
    env = step_environment(scratch, {"HOME": str(home), "TRITON_CACHE_DIR": "/shared/triton"})
    assert "HF_HOME" not in env and "MEGAREASON_CACHE" not in env and "HOME" not in env  # the user's models stay
    assert "TRITON_CACHE_DIR" not in env  # the site's
    assert env["VLLM_CACHE_ROOT"] == str(scratch / "cache" / "vllm")  # caches: the scratch, home or not
    assert env["TMPDIR"] == str(scratch / "tmp")
    env = step_environment(scratch, {"HOME": str(home), "TMPDIR": str(tmp_path)})
    assert "TMPDIR" not in env  # a node-local TMPDIR that can be written (job_container/tmpfs) stays
    env = step_environment(scratch, {"HOME": str(home), "HF_HOME": "/models/read-only"})
    assert "HF_HOME" not in env  # a model store the site set is kept, even read-only (models fetched before)


def test_a_steps_folder_is_its_nodes_ray_temp_dir_or_its_own_and_the_wrapper_removes_an_ephemeral_one(tmp_path):
    env = {"MR_NODES": "n1 n2 ", "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "41", "SLURM_STEP_ID": "3",
           "MR_RAY_TMPDIR": str(tmp_path)}
    assert node_scratch(env) == tmp_path / "mr-ray-41-1"  # slurm/ray_cluster.sh's --temp-dir for node 2
    assert node_scratch(env, ephemeral=True) == tmp_path / "mr-step-41.3-1"
    with pytest.raises(ValueError, match="node 'n9' is not in the job's node list"):
        node_scratch({**env, "SLURMD_NODENAME": "n9"})
    script = "import os, tempfile; print(tempfile.gettempdir(), os.environ['MPLCONFIGDIR'])"
    proc = subprocess.run([sys.executable, "-m", "megareason.launch.job_env", "--ephemeral", "--", sys.executable,
                           "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    step = tmp_path / "mr-step-41.3-1"
    assert proc.stdout.split() == [str(step / "tmp"), str(step / "config" / "matplotlib")]
    assert not step.exists()
