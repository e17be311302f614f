"""`megareason launch`: NeMo-Run's Slurm executor (dry run: the sbatch script) and local executor (a real run).

NeMo-Run cannot be installed beside vLLM, so these tests create the launcher's own venv (.venv-launch,
`megareason.launch.launch_env`, about 1.5 minutes the first time, reused while pyproject's pins are the same)
and run `megareason launch` from the main environment, which hands over to that venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megareason.launch import launch_env
from megareason.launch.nemo_run import LaunchSpec, driver_command, job_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def launch_venv() -> Path:
    return launch_env.ensure()


def _launch(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megareason.cli", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **env})


def test_driver_command_and_node_script():
    spec = LaunchSpec(recipe="raro_70b", executor="slurm", overrides=["data.sources=[{kind: file, path: /d.jsonl}]"])
    assert driver_command(spec) == ("python -m megareason.cli train --config-name raro_70b "
                                    "'data.sources=[{kind: file, path: /d.jsonl}]'")
    script = job_script(spec)
    assert driver_command(spec) + ' "trainer.ray_address=$head"' in script
    assert "ray stop" not in script  # it would stop every Ray on the node, not only this job's
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash
    local = LaunchSpec(recipe="configs/grpo_smollm2_cpu.yaml", python="/venv/bin/python")
    assert job_script(local) == (f"/venv/bin/python -m megareason.cli train --config-name grpo_smollm2_cpu "
                                 f"--config-dir {REPO / 'configs'}\n")


def test_slurm_dry_run_prints_the_sbatch_script(launch_venv, tmp_path):
    proc = _launch("--executor", "slurm", "--dry-run", "--nodes", "2", "--gpus-per-node", "8", "--partition", "batch",
                   "--container-image", "/images/megareason.sqsh", "--container-mounts", "/data:/data,/models:/models",
                   "--job-dir", str(tmp_path), "raro_70b", "model.path=/models/Llama-3.3-70B-Instruct",
                   "trainer.steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for text in ("#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=batch", "--container-image /images/megareason.sqsh",
                 "--container-mounts /data:/data,/models:/models", "export RAY_AUTH_MODE=token",
                 "python -m megareason.cli train --config-name raro_70b model.path=/models/Llama-3.3-70B-Instruct "
                 'trainer.steps=2 "trainer.ray_address=$head"', "ray start --head"):
        assert text in out, f"{text!r} not in the dry run:\n{out}"
    assert not any(tmp_path.iterdir()), "a dry run writes nothing"


def test_launch_refuses_a_bad_override_before_submitting(launch_venv, tmp_path):
    proc = _launch("--executor", "slurm", "--dry-run", "--job-dir", str(tmp_path), "raro_70b", "trainer.stepz=2")
    assert proc.returncode == 2
    assert "unknown key 'trainer.stepz'" in proc.stderr


REWARD = """\
def vowels(data_source, response, ground_truth, extra_info):
    return sum(ch in "aeiou" for ch in response) / max(len(response), 1)
"""


@pytest.mark.slow
def test_local_executor_runs_a_one_step_recipe(launch_venv, tiny_qwen2, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    out = tmp_path / "run"
    proc = _launch(
        "--executor", "local", "--python", sys.executable, "--job-dir", str(tmp_path / "jobs"), "grpo_smollm2_cpu",
        f"model.path={tiny_qwen2}", f"trainer.output_dir={out}", f"reward.custom={reward}:vowels",
        "trainer.steps=1", "trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=16",
        "rollout.max_model_len=256", "data.max_prompt_length=128", "trainer.micro_batch_tokens=256",
        "trainer.val_before_train=false", "data.sources=[{kind: reasoning_gym, name: basic_arithmetic, size: 8}]",
        "data.val_sources=[]", timeout=800, NEMORUN_HOME=str(tmp_path / "nemo_run"), VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONUNBUFFERED="1")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "grpo_smollm2_cpu: SUCCEEDED" in proc.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "actor/grad_norm" in m] == [1]
    assert (out / "checkpoints").is_dir()
