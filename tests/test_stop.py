"""Stopping at any moment: the leftovers of a killed save, the agreement of an SPMD engine's ranks on the
engine step at which they give up a generation, the stop between micro-batches of the log-prob and training
passes (before the step's first optimizer step), and the pre-emption lead these bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megareason.trainer.run_dir import RunDir, RunFolderBusy, TrainerState

_HOLD = ("import sys, time\nfrom megareason.trainer.run_dir import hold_run_lock\n"
         "hold_run_lock(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)\n")


class _Role:
    """A trained role that writes and reads a checkpoint like a model does."""

    name, loaded = "actor", ""

    def save(self, path: str, meta: dict) -> None:

        Path(path).mkdir(parents=True)
        (Path(path) / "model.pt").write_text(f"weights of step {meta['step']}")

    def load(self, path: str) -> None:

        self.loaded = (Path(path) / "model.pt").read_text()

    def sync_weights(self) -> None:
        pass

    def stop_generating_on(self, path: str) -> None:
        pass


def test_a_killed_saves_leftovers_are_removed_at_the_next_start_once_the_lock_is_held(tmp_path):
    """A save killed mid-write leaves ``.step_N.tmp`` (here with a file in it). While another process holds
    the run lock (it may be writing that folder) a second run is refused and removes nothing; the next run
    that holds the lock removes every leftover before it resumes from the last complete checkpoint."""
    from megareason.config import load_config
    from megareason.trainer.driver import Driver
    from megareason.trainer.loop import train

    run = RunDir(tmp_path / "run")
    tmp = run.begin_checkpoint(2)
    _Role().save(str(tmp / "actor"), {"step": 2})
    run.commit_checkpoint(tmp, TrainerState(step=2), keep_last=2)
    for step in (3, 4):  # two killed saves, one with a half-written file
        killed = run.begin_checkpoint(step)
    (killed / "actor").mkdir()
    (killed / "actor" / "shard_0.distcp").write_bytes(b"\0" * 4096)
    leftovers = sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith("."))
    assert leftovers == [".step_00000003.tmp", ".step_00000004.tmp"]

    cfg = load_config("grpo_smollm2_cpu", [f"trainer.output_dir={run.root}", "trainer.steps=4",
                                           "trainer.val_before_train=false"])
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy):
            train(cfg)
        assert sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith(".")) == leftovers
    finally:
        holder.kill()
        holder.wait()

    role = _Role()
    driver = Driver(cfg, run, [role], 16, "training", None)
    assert driver.start().step == 2 and role.loaded == "weights of step 2"
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_00000002"]


def _fake_scontrol(tmp_path, state: str) -> dict[str, str]:
    """A stand-in ``scontrol`` on PATH: ``show job`` reports ``state``; every call is logged in tmp/calls."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
echo "scontrol $*" >> {tmp_path}/calls
[[ $1 == show ]] && echo "JobId=41 JobName=x JobState={state} Reason=None"
exit 0
""")
    (bin_dir / "scontrol").chmod(0o755)
    (tmp_path / "calls").write_text("")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "41"}


def _job_script(body: str, env: dict[str, str], tmp_path, ray_stops: str = "") -> str:
    """``body`` after sourcing slurm/ray_cluster.sh, with one stand-in Ray step and the script's TERM and EXIT
    traps; its exit code and its log lines, with the stand-in scontrol's calls interleaved in order.
    ``ray_stops``: a command the Ray step runs once it sees the stop file, before it ends."""
    import os

    repo = Path(__file__).resolve().parents[1]
    jobdir = tmp_path / "job"
    jobdir.mkdir(exist_ok=True)
    script = (f'source "{repo}/slurm/ray_cluster.sh" || exit 99\n'
              f'MR_JOBDIR={jobdir} MR_REQUEUED=0 MR_SIGNALS=0 MR_DRIVER= MR_DRIVER_PIDFILE={jobdir}/driver.pid\n'
              # a Ray step ends once it sees the stop file, as megareason/launch/ray_node.py does
              f"(while [[ ! -e {jobdir}/ray.stop ]]; do sleep 0.1; done) >/dev/null 2>&1 & MR_RAY_STEPS=($!)\n"
              "_mr_log() { echo \"megareason-slurm: $*\" >> " + str(tmp_path / "calls") + "; }\n"
              "trap '_mr_on_signal TERM' TERM\ntrap '_mr_teardown; _mr_clean_jobdir' EXIT\n" + body)
    proc = subprocess.run(["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    return f"exit {proc.returncode}\n" + (tmp_path / "calls").read_text()


def test_after_a_checkpoint_the_job_tears_ray_down_then_requeues(tmp_path):
    """Exit code 75 from the driver: Ray's teardown first (its steps keep Ray's logs; a requeue's SIGTERM to the
    steps would cut that short), then ``scontrol requeue``, once; a failure exits with its code after the
    teardown. (The time limit's SIGTERM requeues first thing: the next test.)"""
    out = _job_script("_mr_driver_exited 75", _fake_scontrol(tmp_path, "RUNNING"), tmp_path)
    lines = out.splitlines()
    assert lines[0] == f"exit {75}", out
    assert lines[1] == "megareason-slurm: driver exited with 75"
    assert lines[2] == "megareason-slurm: Ray stopped", out
    assert lines[3].startswith("megareason-slurm: requeueing job 41 (the driver stopped after a checkpoint)"), out
    assert lines[4] == "scontrol requeue 41" and lines.count("scontrol requeue 41") == 1, out
    out = _job_script("_mr_driver_exited 1", _fake_scontrol(tmp_path, "RUNNING"), tmp_path)
    assert out.splitlines() == ["exit 1", "megareason-slurm: driver exited with 1", "megareason-slurm: Ray stopped"]


def test_a_time_limit_during_the_teardown_after_a_checkpoint_still_requeues_at_once(tmp_path):
    """The driver exited 75 and Ray's teardown is slow (its step ends only once the job is requeued, or after
    20 s); the time limit comes during it (JobState=TIMEOUT, SIGTERM to the script): the trap requeues at once,
    before Ray has stopped, and only once. A requeue after the teardown alone could be cut off by the SIGKILL
    that follows KillWait."""
    calls = tmp_path / "calls"
    linger = f"for _ in $(seq 200); do grep -q 'scontrol requeue' {calls} && break; sleep 0.1; done"
    body = (f"(while [[ ! -e {tmp_path}/job/ray.stop ]]; do sleep 0.1; done; kill -TERM $$) &\n"
            "_mr_driver_exited 75")
    out = _job_script(body, _fake_scontrol(tmp_path, "TIMEOUT"), tmp_path, ray_stops=linger)
    lines = [line for line in out.splitlines() if not line.startswith("scontrol show")]
    assert lines[0] == "exit 75" and lines.count("scontrol requeue 41") == 1, out
    assert out.index("requeueing job 41 (SIGTERM at the time limit (JobState=TIMEOUT))") < out.index("Ray stopped")
    assert out.index("scontrol requeue 41") < out.index("Ray stopped"), out


@pytest.mark.parametrize(("state", "requeued"), [("TIMEOUT", True), ("CANCELLED", False), ("RUNNING", False)])
def test_sigterm_to_the_job_script_requeues_at_the_time_limit_and_not_after_scancel(tmp_path, state, requeued):
    """A missed deadline: Slurm marks the job TIMEOUT, then sends SIGTERM to the script (SIGKILL follows after
    KillWait): the trap requeues at once, once, before anything else. After scancel (CANCELLED) it never
    requeues; in a pre-emption's grace time (RUNNING) the driver's checkpoint and exit code 75 do."""
    out = _job_script("kill -TERM $$\nkill -TERM $$\nexit 1", _fake_scontrol(tmp_path, state), tmp_path)
    assert out.count("scontrol requeue 41") == (1 if requeued else 0), out
    if requeued:
        assert "requeueing job 41 (SIGTERM at the time limit (JobState=TIMEOUT))" in out
        assert out.index("scontrol requeue 41") < out.index("Ray stopped")
    if state == "CANCELLED":
        assert "the job was cancelled (JobState=CANCELLED): not requeued" in out


def _pieces_worker(model_dir: str, tokens, mask):
    """At DP 2 and at PP 2: a training pass and a log-prob pass cut into pieces with stop checks that
    never stop, against one schedule call over all micro-batches; then a stop that only rank 1 sees, at its
    third check, against the same pass. The data-parallel layout gives the replicas 5 and 3 micro-batches."""
    return {(tp, pp): _pieces_on(tp, pp, model_dir, tokens, mask) for tp, pp in ((1, 1), (1, 2))}


def _nll(logp_BT, entropy_BT, batch):
    m = batch.loss_mask_BT
    return -(logp_BT * m).sum(), m.sum(), {"entropy_sum": (entropy_BT * m).sum()}


def _pieces_on(tp: int, pp: int, model_dir: str, tokens, mask) -> dict:
    import torch

    from megareason.config.schema import Config
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.parallel import init_parallel
    from megareason.models.schedule import PassStopped, agreed_stop, forward_backward, forward_outputs
    from megareason.models.train import TrainBatch, wrap_for_training
    from megareason.settings import optimizer_settings

    layout = init_parallel(tp, pp)
    ckpt = HFCheckpoint(model_dir)
    model = build_gpt(ckpt.arch)
    load_hf_weights(model, ckpt)
    ddp, _ = wrap_for_training(model, optimizer_settings(Config(), 1e-3))
    rows = (slice(0, 5), slice(5, 8))[layout.dp_rank] if layout.dp > 1 else slice(0, 8)
    micro = [TrainBatch(t[None], m[None]) for t, m in zip(tokens[rows], mask[rows], strict=True)]
    head = logprob_head(ckpt.arch.vocab_size)

    def grads():
        return {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}

    whole = forward_backward(ddp, micro, head, _nll)
    whole_grads = grads()
    asked = []
    cut = forward_backward(ddp, micro, head, _nll, agreed_stop(lambda: asked.append(1) or False))
    same = whole == cut and all(torch.equal(g, whole_grads[n]) for n, g in grads().items())
    plain = forward_outputs(ddp.module, micro, head, 2)
    pieces = forward_outputs(ddp.module, micro, head, 2, agreed_stop(lambda: False))
    same_logp = all(torch.equal(a, b) for x, y in zip(plain, pieces, strict=True) for a, b in zip(x, y, strict=True))
    stopped = []
    for run in (lambda s: forward_backward(ddp, micro, head, _nll, s),
                lambda s: forward_outputs(ddp.module, micro, head, 2, s)):
        seen = []

        def local(seen=seen):
            seen.append(1)
            return torch.distributed.get_rank() == 1 and len(seen) >= 3  # only rank 1 sees it, at its 3rd check

        try:
            run(agreed_stop(local))
            stopped.append(None)
        except PassStopped as e:
            stopped.append(str(e))
    return dict(same=same, same_logp=same_logp, checks=len(asked), stopped=stopped, dp_rank=layout.dp_rank,
                n=len(micro))


@pytest.mark.parametrize("family", ["tiny_qwen2"])
def test_a_pass_in_pieces_equals_one_schedule_call_and_every_rank_stops_at_the_same_piece(family, request):
    """Cutting a pass into pieces with a stop check before each changes nothing (gradients, metrics and
    log-probs bit-equal to one megatron-core schedule call, at DP 2 with unequal shares and at PP 2); a stop
    seen by one rank only stops every rank before the same piece, none waits alone in a collective."""
    import torch
    from distributed import run_workers

    from megareason.models.arch import ModelArch
    from megareason.models.schedule import PIECES, PIECES_PIPELINED

    vocab = ModelArch.from_pretrained(request.getfixturevalue(family)).vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (8, 12), generator=g)
    mask = torch.zeros(8, 12)
    for i in range(8):
        mask[i, 3 + i % 3: 12 - i % 4] = 1.0
    per_rank = run_workers(2, _pieces_worker, str(request.getfixturevalue(family)), tokens, mask, timeout=300)
    for layout, k in (((1, 1), PIECES), ((1, 2), PIECES_PIPELINED)):
        ranks = [r[layout] for r in per_rank]
        assert all(r["same"] and r["same_logp"] for r in ranks), layout
        assert all(r["checks"] == k for r in ranks), layout  # every rank asks before each piece
        # Rank 1's third check: both ranks stop before the third piece, after the first two pieces' micro-batches.
        for r in ranks:
            done = sum(len(range(r["n"])[r["n"] * i // k: r["n"] * (i + 1) // k]) for i in range(2))
            want = [f"{what} stopped before piece 3 of {k} ({done} of {r['n']} micro-batches done): the run is "
                    "stopping" for what in ("a training pass", "a log-prob pass")]
            assert r["stopped"] == want, (layout, r)
    assert sorted(r[(1, 1)]["n"] for r in per_rank) == [3, 5]


@pytest.mark.parametrize(("config", "shape", "nodes"), [("raro_70b", "llama-3.1-70b", 8),
                                                         ("grpo_qwen3_8b", "qwen3-8b", 1),
                                                         ("grpo_qwen3_30b_a3b", "qwen3-30b-a3b", 4)])
def test_a_sigterm_is_followed_by_a_checkpoint_within_the_longest_piece_that_cannot_stop_and_the_save(config, shape,
                                                                                                     nodes):
    """The bound ``megareason plan`` prints per recipe, from the plan's seconds per phase by hand: a log-prob
    pass and the first optimizer step stop between pieces (8 at PP 1, 4 at PP > 1), what follows the first
    optimizer step (here: the weight refit; these recipes make one update a step) does not, then the save."""
    from megareason.config import load_config
    from megareason.launch.plan import PlanOptions, plan_config
    from megareason.launch.preemption import plan_lead, plan_stop_bound

    cfg = load_config(config, [])
    plan = plan_config(config, [], PlanOptions(nodes=nodes, gpus_per_node=8), shape)
    alg = cfg.algorithm
    assert (alg.ppo_epochs, alg.mini_batches, alg.name != "ppo") == (1, 1, True)
    n = 4 if cfg.parallel.pipeline_model_parallel_size > 1 else 8
    logprob_passes = 1 if alg.kl_coef > 0 else 0  # the reference's; on-policy: no old log-probs
    bound = plan_stop_bound(plan, cfg)
    s = plan.seconds
    want = max(s["logprobs"] / max(logprob_passes, 1) / n, s["training"] / n, s["weight refit"], 0.5)
    assert bound.longest[1] == pytest.approx(want)
    assert bound.seconds == pytest.approx(want + plan_lead(plan, cfg).checkpoint_s)
    # far less than what a stop after the step in progress needs: a whole step, then the save
    assert bound.seconds < plan_lead(plan, cfg).step_s + plan_lead(plan, cfg).checkpoint_s
    assert bound.line().startswith(f"a pre-emption's SIGTERM: a checkpoint within {bound.seconds:.0f} s, the longest "
                                   f"piece that cannot stop ({bound.longest[0]}, ")


def test_a_failed_node_ends_in_a_requeue_that_excludes_it(tmp_path):
    """The driver fails (exit 1) because node n2 died (Slurm already marks it not responding: IDLE*) and n3's
    slurmd no longer runs steps (the probe step fails). On a cluster where Slurm never marks a node DOWN
    (SlurmdTimeout=0) the script requeues the job itself: held, its ExcNodeList gets both (after the user's
    own n9, each change read back), released, and it exits 75 before Ray's teardown. With every node healthy
    the failure stands. (Where Slurm marks dead nodes DOWN the script waits for Slurm's own requeue:
    ``tests/test_slurm.py``, on a real cluster.)"""
    env = _fake_scontrol(tmp_path, "RUNNING")
    bin_dir = tmp_path / "bin"
    (tmp_path / "exc").write_text("n9")
    (tmp_path / "reason").write_text("None")
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
echo "scontrol $*" >> {tmp_path}/calls
case "$1 $2" in
  "show node") [[ $3 == n2 && -e {tmp_path}/dead ]] && echo "NodeName=n2 State=IDLE*" ||
               echo "NodeName=$3 State=ALLOCATED" ;;
  "show job") echo "JobId=41 JobState=RUNNING Reason=$(<{tmp_path}/reason) Requeue=1 ExcNodeList=$(<{tmp_path}/exc)" ;;
  "show config") echo "SlurmdTimeout           = 0 sec" ;;
  "update JobId=41") echo "${{3#ExcNodeList=}}" > {tmp_path}/exc ;;
  "requeuehold 41") echo job_requeued_in_held_state > {tmp_path}/reason ;;
  "release 41") echo None > {tmp_path}/reason ;;
esac
exit 0
""")
    (bin_dir / "srun").write_text(f"""#!/bin/bash
[[ -e {tmp_path}/dead && " $* " == *" -w n3 "* ]] && exit 1
exit 0
""")
    (bin_dir / "srun").chmod(0o755)
    env = {**env, "MR_NODES": "n1 n2 n3"}
    healthy = _job_script("_mr_driver_exited 1", env, tmp_path)
    assert healthy.splitlines()[0] == "exit 1" and "requeue" not in healthy, healthy
    (tmp_path / "dead").touch()
    (tmp_path / "calls").write_text("")
    out = _job_script("_mr_driver_exited 1", env, tmp_path)
    lines = [line for line in out.splitlines() if not line.startswith("scontrol show")]
    assert lines == ["exit 75", "megareason-slurm: driver exited with 1",
                     "megareason-slurm: node(s) n2,n3 down or not answering (n2 IDLE*, n3 no-answer): requeueing job "
                     "41 without them; the next run resumes from the latest checkpoint",
                     "scontrol requeuehold 41", "scontrol update JobId=41 ExcNodeList=n9,n2,n3",
                     "megareason-slurm: job 41 requeued held, its ExcNodeList set to n9,n2,n3",
                     "scontrol release 41", "megareason-slurm: job 41 released", "megareason-slurm: Ray stopped"], out


class _Actors:
    """The policy's handle as ``loop._update`` calls it: records each call; ``stop_in``: the pass that a
    SIGTERM ends ("logprobs", "train": only where the worker would stop, i.e. a stoppable training pass)."""

    def __init__(self, stop_in: str = ""):
        self.calls, self.stop_in = [], stop_in

    def sleep_engine(self):
        self.calls.append("sleep")

    def logprobs(self, exp):
        from megareason.rollout.records import UpdateStopped

        self.calls.append("logprobs")
        if self.stop_in == "logprobs":
            raise UpdateStopped("a log-prob pass stopped before piece 5 of 8 (1 of 2 micro-batches done): the run "
                                "is stopping")
        return exp.rollout_logp_BT, exp.rollout_logp_BT

    def train(self, exp, lr, on_policy, stoppable=False):
        from megareason.rollout.records import UpdateStopped

        self.calls.append(f"train stoppable={stoppable}")
        if self.stop_in == "train" and stoppable:
            raise UpdateStopped("a training pass stopped before piece 5 of 8 (1 of 2 micro-batches done): the run "
                                "is stopping")
        return None  # the stats are not read here

    def sync_weights(self):
        self.calls.append("sync")
        return []


@pytest.mark.parametrize("stop_in", ["", "logprobs", "train"])
def test_only_the_log_probs_and_the_first_optimizer_step_of_a_step_may_stop(stop_in):
    """PPO epochs 2 x mini-batches 2: four optimizer steps a step, of which only the first pass may stop (the
    model holds part of the step after it); a stop in the log-probs or in that first pass ends the update
    before any optimizer step and before the sync, so the step can be dropped with the model unchanged."""
    import torch

    from megareason.config import load_config
    from megareason.rollout.records import UpdateStopped
    from megareason.trainer.loop import _update, mini_batch_rows
    from megareason.trainer.steps import StepRows

    cfg = load_config("grpo_smollm2_cpu", ["algorithm.ppo_epochs=2", "algorithm.mini_batches=2",
                                           "parallel.data_parallel_size=1", "algorithm.kl_coef=0"])
    from test_trainer_units import _experience

    exp = _experience()
    rows = StepRows(exp=exp, reward_B=torch.tensor([1.0, 0.0, 0.0, 1.0]), group_B=torch.tensor([0, 0, 1, 1]),
                    is_critic_B=None, scored=[])
    actors = _Actors(stop_in)
    if not stop_in:
        _update(cfg, 1, actors, None, rows, mini_batch_rows(cfg, rows), False, {})
        assert actors.calls == ["sleep", "logprobs", "train stoppable=True"] + ["train stoppable=False"] * 3 + ["sync"]
        return
    with pytest.raises(UpdateStopped):
        _update(cfg, 1, actors, None, rows, mini_batch_rows(cfg, rows), False, {})
    assert actors.calls == {"logprobs": ["sleep", "logprobs"],
                            "train": ["sleep", "logprobs", "train stoppable=True"]}[stop_in]


def test_a_sigterm_in_a_steps_update_saves_the_step_before_it_and_every_role_sees_the_stop_file(tmp_path, caplog):
    """Every trained role (the policy's engines and passes, the critic's passes) is given the stop file at the
    start; a SIGTERM during step 2's log-probs or first optimizer step (the loop catches ``UpdateStopped``) drops
    step 2: the state after step 1 is saved, the run exits with EXIT_STOPPED and resumes at step 2."""
    import os
    import signal

    from megareason.config import load_config
    from megareason.trainer.driver import EXIT_STOPPED, Driver, stop_signals

    class Role(_Role):
        def stop_generating_on(self, path: str) -> None:
            self.stop_path = path

    cfg = load_config("grpo_smollm2_cpu", [f"trainer.output_dir={tmp_path}", "trainer.save_every=0", "trainer.steps=4",
                                           "trainer.val_before_train=false"])
    policy, critic = Role(), Role()
    critic.name = "critic"
    with stop_signals() as stop:
        driver = Driver(cfg, RunDir(tmp_path), [policy, critic], 16, "training", None, stop)
        driver.start()
        stop_file = RunDir(tmp_path).stop_file.resolve()
        assert policy.stop_path == critic.stop_path == str(stop_file) and not stop_file.exists()
        with pytest.raises(SystemExit) as stopped:
            for step, _ in driver.steps():
                if step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                    assert stop_file.exists()  # what the workers look at between pieces of their passes
                    driver.drop_step(step, "log-probs or first optimizer step")
                driver.end_step(step, {"loss": float(step)})
    assert stopped.value.code == EXIT_STOPPED
    assert RunDir(tmp_path).steps() == [1]
    assert "SIGTERM during step 2's log-probs or first optimizer step: the step was dropped, the run resumes at " \
           "step 2" in caplog.text
    resumed = Driver(cfg, RunDir(tmp_path), [Role(), Role()], 16, "training", None)
    assert resumed.start().step == 1


def _phase_stub():
    """``test_engine_state.StubPolicy`` (the real loop, driver, engine state machine and checkpoints over stub
    Megatron parts) whose passes stop as the real workers' do: a log-prob pass and a stoppable training pass
    raise ``UpdateStopped`` once the stop file exists; ``fire = (phase, n)`` sends this process a SIGTERM in the
    n-th pass through ``phase`` (logprobs, train, sync, save), as a pre-emption at that moment would."""
    import signal

    from test_engine_state import StubPolicy

    from megareason.rollout.records import UpdateStopped

    class PhaseStub(StubPolicy):
        fire: tuple[str, int] | None = None
        seen: dict

        def _reach(self, phase: str) -> None:
            self.seen = getattr(self, "seen", {})
            self.seen[phase] = self.seen.get(phase, 0) + 1
            if self.fire == (phase, self.seen[phase]):
                os.kill(os.getpid(), signal.SIGTERM)

        def _stopped(self, what: str) -> None:
            if self.stop_path is not None and os.path.exists(self.stop_path):
                raise UpdateStopped(f"{what} stopped before piece 5 of 8 (1 of 2 micro-batches done): the run is "
                                    "stopping")

        def logprobs(self, exp):
            self._reach("logprobs")
            self._stopped("a log-prob pass")
            return super().logprobs(exp)

        def train(self, exp, lr, on_policy, stoppable=False):
            if stoppable:
                self._reach("train")
                self._stopped("a training pass")
            return super().train(exp, lr, on_policy)

        def sync_weights(self):
            self._reach("sync")
            return super().sync_weights()

        def _write_checkpoint(self, path, metadata, asynchronous):
            self._reach("save")
            super()._write_checkpoint(path, metadata, asynchronous)

    return PhaseStub


def _stub_run(cfg, out, prompts, val, tok, fire=None):
    """The real ``_train_loop`` over one ``_phase_stub`` rank; with ``fire``, under the driver's signal handling,
    expecting EXIT_STOPPED. The worker."""
    from test_engine_state import InProcessGroup, _reply, _score

    from megareason.trainer.driver import EXIT_STOPPED, stop_signals
    from megareason.trainer.loop import _train_loop

    worker = _phase_stub()(cfg, 0, 1, tok, _reply)
    worker.fire, groups = fire, [InProcessGroup("actor", [worker])]
    with stop_signals() as stop:
        if fire is None:
            _train_loop(cfg, RunDir(str(out)), groups, prompts, val, _score, tok, stop=stop)
            return worker
        with pytest.raises(SystemExit) as stopped:
            _train_loop(cfg, RunDir(str(out)), groups, prompts, val, _score, tok, stop=stop)
    assert stopped.value.code == EXIT_STOPPED
    return worker


def test_a_sigterm_in_each_phase_of_the_loop_saves_what_the_stop_promises_and_resumes_exactly(tmp_path, caplog):
    """The loop and the driver, in process, two optimizer steps a step (mini-batches) and a checkpoint every
    step, one run folder stopped by a real SIGTERM in each phase and resumed: in a checkpoint write (it
    completes; the next step's generation gives up), in a log-prob pass and in the first optimizer step (the
    step is dropped, the model unchanged), in the weight sync (it completes; the step is saved). Every stopped
    run exits with EXIT_STOPPED leaving the checkpoint the stop promises; together the runs log the
    uninterrupted run's rows and generate its prompts."""
    import json

    from test_engine_state import _cfg, _prompts

    from megareason.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = _cfg("grpo_smollm2_cpu", ["trainer.steps=6", "trainer.val_every=0", "trainer.val_before_train=false",
                                    "trainer.save_every=1", "trainer.keep_last=1", "algorithm.mini_batches=2"])
    prompts, val = _prompts(tok, 5), _prompts(tok, 2)
    straight = _stub_run(cfg, tmp_path / "straight", prompts, val, tok)
    out = tmp_path / "stopped"
    workers = []
    for fire, latest, line in [(("save", 2), 2, "SIGTERM during step 3's generation: the step was dropped"),
                               (("logprobs", 2), 3, "SIGTERM during step 4's log-probs or first optimizer step"),
                               (("train", 2), 4, "SIGTERM during step 5's log-probs or first optimizer step"),
                               (("sync", 2), 5, "SIGTERM: stopped after step 5 with a checkpoint")]:
        caplog.clear()
        workers.append(_stub_run(cfg, out, prompts, val, tok, fire))
        assert RunDir(str(out)).steps() == [latest], fire
        assert line in caplog.text, (fire, caplog.text[-2000:])
    workers.append(_stub_run(cfg, out, prompts, val, tok))
    assert RunDir(str(out)).steps() == [6]

    def rows(folder):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/"))}
                for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert rows(out) == rows(tmp_path / "straight") and [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    # the prompts each step generated from: the dropped steps' generations were repeated on the same prompts
    generated = [p for w in workers for p in w.vllm.prompts]
    assert [p for p in generated if p not in straight.vllm.prompts] == []
