"""`megareason launch`: NeMo-Run's Slurm path (the job script it renders, and a real job on the loopback
Slurm cluster: 2 steps, SIGUSR1, requeue, resume) and its local executor (a real run).

NeMo-Run cannot be installed beside vLLM, so these tests create the launcher's own venv (.venv-launch,
`megareason.launch.launch_env`, about 1.5 minutes the first time, reused while pyproject's pins are the same)
and run `megareason launch` from the main environment, which hands over to that venv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_cluster
from slurm_cluster import SAME_KEYS, metrics, tiny_raro, wait_for_loop

from megareason.launch import launch_env
from megareason.launch.nemo_run import LaunchSpec, driver_command, job_body, sbatch_directives, slurm_directives

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def launch_venv() -> Path:
    return launch_env.ensure()


def _launch(*args: str, timeout: float = 300, env: dict[str, str] | None = None, **extra: str):
    return subprocess.run([sys.executable, "-m", "megareason.cli", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**(env or os.environ), **extra})


def test_the_slurm_job_takes_the_recipes_directives_and_an_absolute_run_folder():
    spec = LaunchSpec(recipe="raro_70b", executor="slurm", nodes=2, gpus_per_node=0, time="30",
                      overrides=["data.sources=[{kind: file, path: /d.jsonl}]", "trainer.output_dir=runs/x"])
    d = slurm_directives(spec)
    own = sbatch_directives(REPO / "slurm" / "raro_70b.sbatch")
    assert own["signal"] == d["signal"] and d["mem"] == "0" and d["exclusive"] is True and d["requeue"] is True
    assert d["nodes"] == "2" and d["time"] == "30" and "gpus-per-node" not in d  # the flags win; 0: no GPUs
    assert "job-name" not in d and "output" not in d  # NeMo-Run's
    body = job_body(spec)
    assert body.startswith(f"source {REPO / 'slurm' / 'ray_cluster.sh'} || exit 1\n")
    assert ("megareason_slurm_run raro_70b 'data.sources=[{kind: file, path: /d.jsonl}]' "
            f"trainer.output_dir=runs/x trainer.output_dir={REPO / 'runs' / 'x'}\n") in body
    # a recipe without its own sbatch script gets slurm/train.sbatch's directives
    generic = slurm_directives(LaunchSpec(recipe="grpo_quickstart", executor="slurm"))
    assert generic == {k: v for k, v in sbatch_directives(REPO / "slurm" / "train.sbatch").items()
                       if k not in ("job-name", "output")}
    local = LaunchSpec(recipe="configs/grpo_smollm2_cpu.yaml", python="/venv/bin/python")
    assert driver_command(local) == (f"/venv/bin/python -m megareason.cli train --config-name grpo_smollm2_cpu "
                                     f"--config-dir {REPO / 'configs'}")


def test_slurm_dry_run_prints_the_job_script(launch_venv, tmp_path):
    proc = _launch("--executor", "slurm", "--dry-run", "--partition", "batch",
                   "--container-image", "/images/megareason.sqsh", "--container-mounts", "/data:/data,/models:/models",
                   "--job-dir", str(tmp_path), "raro_70b", "model.path=/models/Llama-3.3-70B-Instruct",
                   "trainer.steps=2", NCCL_SOCKET_IFNAME="ib0,ib1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    script_directives = set(re.findall(r"^#SBATCH (.*)$", out, re.M))
    recipe = {f"--{k}" if v is True else f"--{k}={v}"
              for k, v in sbatch_directives(REPO / "slurm" / "raro_70b.sbatch").items()
              if k not in ("job-name", "output")}
    assert recipe <= script_directives, recipe - script_directives  # the sbatch recipe's resources, all of them
    assert "--partition=batch" in script_directives and "--job-name=megareason-raro_70b" in script_directives
    output = next(d for d in script_directives if d.startswith("--output="))
    assert output.startswith(f"--output={tmp_path}/logs/")  # absolute, under --job-dir
    for text in ("export MEGAREASON_CONTAINER_IMAGE=/images/megareason.sqsh",
                 "export MEGAREASON_CONTAINER_MOUNTS=/data:/data,/models:/models", "export NCCL_SOCKET_IFNAME=ib0,ib1",
                 f"export MEGAREASON_ROOT={REPO}", f"source {REPO}/slurm/ray_cluster.sh || exit 1",
                 "megareason_slurm_run raro_70b model.path=/models/Llama-3.3-70B-Instruct trainer.steps=2 "
                 f"trainer.output_dir={REPO}/outputs/raro_70b"):
        assert text in out, f"{text!r} not in the dry run:\n{out}"
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)  # valid bash
    assert not (tmp_path / "logs").exists(), "a dry run submits nothing"


def test_launch_refuses_bad_input_naming_it(launch_venv, tmp_path):
    proc = _launch("--executor", "slurm", "--dry-run", "--job-dir", str(tmp_path), "raro_70b", "trainer.stepz=2")
    assert proc.returncode == 2 and "unknown key 'trainer.stepz'" in proc.stderr
    proc = _launch("--executor", "slurm", "--dry-run", "--job-dir", str(tmp_path), "--nodes", "0", "raro_70b")
    assert proc.returncode == 2 and "--nodes must be >= 1" in proc.stderr
    proc = _launch("--executor", "slurm", "--run", "eval", "--dry-run", "--job-dir", str(tmp_path), "eval")
    assert proc.returncode == 2 and "--run eval" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_slurm_job_trains_2_steps_requeues_on_usr1_and_resumes(launch_venv, slurm, slurm_reference, tiny_qwen2,
                                                               tmp_path):
    """`megareason launch --executor slurm` submits to the loopback cluster (NeMo-Run renders and submits the
    job); SIGUSR1 to the job script, as `--signal=B:USR1@LEAD` sends it, during step 1: checkpoint, requeue,
    resume, the reference run's losses."""
    out = tmp_path / "run"
    proc = _launch("--executor", "slurm", "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "1",
                   "--time", "90", "--job-dir", str(tmp_path / "jobs"), "raro_70b",
                   *tiny_raro(tiny_qwen2, tmp_path, out), env=slurm.env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(r"submitted raro_70b: Slurm job (\d+); run folder (\S+); job log (\S+);", proc.stdout)
    assert found and found.group(2) == str(out), proc.stdout[-3000:]
    job, log = found.group(1), Path(found.group(3))
    wait_for_loop(out, None, log)
    assert slurm.run("scancel", "--signal=USR1", "--batch", job).returncode == 0
    state = slurm.wait_for_job(job, timeout=1500)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, text[-6000:])
    assert "SIGUSR1 (time limit or pre-emption ahead)" in text and "SIGUSR1: stopped after step 1" in text
    assert f"requeueing job {job}" in text and "restart 1" in text and "resuming from" in text
    script = next((tmp_path / "jobs" / "experiments").rglob("*_sbatch.sh")).read_text()
    assert "#SBATCH --signal=B:USR1@1800" in script and "#SBATCH --mem=0" in script  # the recipe's
    resumed, reference = metrics(out), metrics(slurm_reference[2])
    assert sorted(resumed) == [1, 2]
    for step in (1, 2):
        for key in SAME_KEYS:
            assert resumed[step][key] == reference[step][key], (step, key)
    assert list((out / "ray_logs" / "restart_1" / "n1").glob("raylet*.out"))
    slurm_cluster.assert_cleaned_up(slurm)


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
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m if "actor/grad_norm" in r] == [1]
    assert (out / "checkpoints").is_dir()
