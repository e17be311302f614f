"""`megareason launch`: NeMo-Run's Slurm path (the job script it renders, and a real job on the loopback
Slurm cluster: 3 steps, SIGUSR1, requeue, SIGTERM, requeue, resume) and its local executor (a real PPO run).

NeMo-Run cannot be installed beside vLLM, so these tests create the launcher's own venv (.venv-launch,
`megareason.launch.launch_env`, about 1.5 minutes the first time, reused while pyproject's pins are the same;
conftest.py's `launch_venv` starts it while the unit tests run)
and run `megareason launch` from the main environment, which hands over to that venv.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
from golden_curves import check_golden, recording
from slurm_cluster import metrics, tiny_raro, wait_for_loop

from megareason.launch.nemo_run import LaunchSpec, driver_command, job_body, sbatch_directives, slurm_directives

REPO = Path(__file__).resolve().parents[1]


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
@pytest.mark.timeout(2400)
def test_slurm_job_on_two_nodes_requeues_on_usr1_then_on_sigterm_and_resumes_to_the_golden_curve(
        launch_venv, slurm, tiny_qwen2, tmp_path, request):
    """The tiny 70B RARO recipe (`slurm_cluster.tiny_raro`, 3 steps, one data-parallel rank per node) as
    `megareason launch --executor slurm` submits it (NeMo-Run renders the job around slurm/ray_cluster.sh,
    as `sbatch slurm/raro_70b.sbatch` runs it), interrupted twice, the two ways a job is told to stop:
    during step 1, SIGUSR1 to the job script (what `--signal=B:USR1@LEAD` sends before the time limit):
    a checkpoint after the step, a requeue; during step 2's generation in the requeued run, SIGTERM alone to
    every process of every job step at once (what a pre-emption sends: the driver, the reward workers,
    `ray start`, the GCS, the raylets, the actors, vLLM), while that generation is held from ending
    (tests/hooks/hold_generation.py: a large model's long generation): the engines give the step up, step 1's
    checkpoint holds the state, and the job requeues within a bounded time, not after the generation. The
    three runs together give the uninterrupted run's metrics, every one of every step (golden "slurm_raro").
    Every job step runs in a sandbox with enroot's defaults (slurm_cluster.sandboxed: the root, the Python
    environment and the checkout read-only, no home; only the run folder and the job's scratch writable), and
    every run of the job runs the code snapshot its first start took."""
    out = tmp_path / "run"
    overrides = tiny_raro(tiny_qwen2, tmp_path, out, "trainer.steps=3")
    if recording():  # the uninterrupted run, for tools/regen_golden.sh
        straight = tmp_path / "straight"
        _, log, proc = slurm_cluster.sbatch(slurm, "straight", *tiny_raro(tiny_qwen2, tmp_path, straight,
                                                                          "trainer.steps=3"))
        assert proc.wait(timeout=1500) == 0, slurm_cluster.read_log(log)[-6000:]
        check_golden("slurm_raro", metrics(straight))
    control, sandbox = tmp_path / "control", tmp_path / "sandbox"  # the test's hold file; the srun in front
    for folder in (control, sandbox, out):
        folder.mkdir()
    hold = control / "hold_generation"
    env = slurm_cluster.sandboxed({**slurm.env, "MEGAREASON_TEST_HOLD_GENERATION": str(hold),
                                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "hooks"),
                                                                               slurm.env.get("PYTHONPATH")]))},
                                  sandbox, out, slurm.ray_tmp, control)
    proc = _launch("--executor", "slurm", "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "1",
                   "--time", "90", "--job-dir", str(tmp_path / "jobs"), "raro_70b", *overrides, env=env,
                   timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(r"submitted raro_70b: Slurm job (\d+); run folder (\S+); job log (\S+);", proc.stdout)
    assert found and found.group(2) == str(out), proc.stdout[-3000:]
    job, log = found.group(1), Path(found.group(3))
    request.addfinalizer(lambda: slurm.cancel(job))
    script = next((tmp_path / "jobs" / "experiments").rglob("*_sbatch.sh")).read_text()
    assert "#SBATCH --signal=B:USR1@1800" in script and "#SBATCH --mem=0" in script  # the recipe's

    wait_for_loop(out, None, log, runs=1)
    assert slurm.run("scancel", "--signal=USR1", "--batch", job).returncode == 0
    slurm_cluster.wait_for_text(log, f"requeueing job {job}", 600)
    hold.touch()  # the requeued run's generations wait until the SIGTERM stops them
    seen = hold.with_name(hold.name + ".seen")
    deadline = time.time() + 900
    while not seen.exists():
        assert time.time() < deadline and slurm.is_live(job), \
            slurm_cluster.read_log(log)[-6000:]
        time.sleep(0.2)
    time.sleep(1.0)  # every engine of the step is generating by now
    sent = time.time()
    assert slurm.run("scancel", "--signal=TERM", job).returncode == 0
    requeued = slurm_cluster.wait_for_text(log, f"requeueing job {job}", 600, count=2)
    hold.unlink()  # the third run generates as usual
    state = slurm.wait_for_job(job, timeout=1500)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "2", (state, text[-6000:])

    # The first run: the node check on each node before Ray, Ray on both, the ranks placed on both.
    first = text[:text.index("restart 1")]
    # Every step of every run in the read-only sandbox, each run on the first start's snapshot of the code.
    assert text.count("read-only sandbox: ") == 3 * 6, text[-6000:]  # node check, run-dir, 2 Ray, wait, driver
    snapshot = out / "code" / f"{slurm.name}-{job}"
    assert text.count(f"code: {snapshot}, the snapshot of {REPO} ") == 3, text[-6000:]
    assert (snapshot / "megareason" / "cli.py").read_text() == (REPO / "megareason" / "cli.py").read_text()
    for node in ("n1", "n2"):
        assert re.search(rf"node-check {node}: gloo: \w+ [\d.]+ \(", first), first[:4000]
        assert f"node-check {node}: NCCL sockets: " in first and f"node-check {node}: ephemeral ports: " in first
    assert "Ray is up: 2 nodes" in first
    # The job's end time (--time 90) reaches the driver, which saves and stops before it unsignalled.
    ends = re.search(r"the Slurm job ends in (\d+) s", first)
    assert ends and 0 < int(ends.group(1)) <= 90 * 60, first[-6000:]
    placed = re.search(r"actor: ranks on (\d) Ray node\(s\): (.*)", first)
    assert placed and placed.group(1) == "2", first[-6000:]
    assert len(set(re.findall(r"rank \d -> \S+ \((\w+)\)", placed.group(2)))) == 2
    # SIGUSR1 in step 1, then SIGTERM in step 2 of the second run: a checkpoint and a requeue each time.
    assert "SIGUSR1 (time limit or pre-emption ahead)" in text and "SIGUSR1: stopped after step 1" in text
    second = text[text.index("restart 1"):]
    assert "megareason-ray-node n1: SIGTERM" in second and "megareason-ray-node n2: SIGTERM" in second
    # Step 2 is dropped (its engines give up its generation; step 1's checkpoint holds the state) and the job
    # requeues within two minutes of the SIGTERM although that generation would never have ended.
    assert "SIGTERM during step 2's generation: the step was dropped" in second, second[-6000:]
    assert "SIGTERM: stopped after step 2" not in second
    lead = requeued - sent
    print(f"SIGTERM during a held generation -> requeue: {lead:.0f} s")
    assert 0 < lead < 120, lead
    assert text.count(f"requeueing job {job}") == 2 and "resuming from" in second
    assert "resuming from" in text[text.index("restart 2"):]
    assert "driver exited with 0" in text and "Ray stopped" in text

    m = metrics(out)
    assert sorted(m) == [1, 2, 3] and "raro/critic_accuracy" in m[3] and m[3]["actor/grad_norm"] > 0
    if not recording():
        check_golden("slurm_raro", m)
    for restart in (0, 1, 2):  # each node's Ray logs, kept per run of the job
        for node in ("n1", "n2"):
            assert list((out / "ray_logs" / f"restart_{restart}" / node).glob("raylet*.out")), (restart, node)
    assert (out / "ray_logs" / "restart_0" / "n1" / "gcs_server.out").is_file()  # the head's
    slurm_cluster.assert_cleaned_up(slurm)


@pytest.mark.slow
def test_local_executor_runs_ppo_with_a_critic_whose_value_loss_falls(launch_venv, tiny_qwen2, tmp_path):
    """`megareason launch --executor local` runs the recipe through NeMo-Run's local executor: here PPO (a
    critic, the KL in the reward, two mini-batches) for 6 steps, whose curve is the golden "ppo" one (recorded
    with k3 in the reward: which estimator the reward reads is test_trainer_losses.py's) — with
    ``trainer.offload_optimizer`` on, so the actor's and critic's gradient buffers and optimizer state leave
    their storages before each engine wake-up (the critic after each update) and come back exactly."""
    from test_train_e2e import _args

    out = tmp_path / "ppo"
    overrides = _args(tiny_qwen2, tmp_path, out, "algorithm.name=ppo", "trainer.steps=6", "optim.critic_lr=1e-3",
                      "algorithm.kl_coef=0.01", "algorithm.kl_in_reward=true", "algorithm.kl_reward_kind=k3",
                      "algorithm.mini_batches=2", "trainer.save_every=0", "trainer.offload_optimizer=true")[4:]
    proc = _launch("--executor", "local", "--python", sys.executable, "--job-dir", str(tmp_path / "jobs"),
                   "grpo_smollm2_cpu", *overrides, timeout=800, NEMORUN_HOME=str(tmp_path / "nemo_run"),
                   VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "grpo_smollm2_cpu: SUCCEEDED" in proc.stdout
    m = metrics(out)
    check_golden("ppo", m)
    losses = [m[s]["critic/vf_loss"] for s in range(1, 7)]
    assert sum(losses[-2:]) / 2 < 0.5 * sum(losses[:2]) / 2, losses
    assert (out / "checkpoints" / "step_00000006" / "critic").is_dir()
    assert all(m[s]["rollout/token_mult_prob_error"] < 1.001 for s in range(1, 7))
    assert "actor/kl" not in m[1] and m[1]["critic/grad_norm"] > 0
    assert all("critic/explained_variance" in m[s] for s in range(1, 7))
    assert (out / "plots" / "critic.png").stat().st_size > 1000  # the run's own curves
