"""The trainer's pure pieces: experience records and packing, the prompt sampler, the run folder,
metrics truncation on resume, advantages as the loop computes them, config checks, custom rewards."""

from __future__ import annotations

import json

import pytest
import torch

from megareason.algorithms.advantages import gae_reference
from megareason.algorithms.estimate import compute_advantages
from megareason.config import ConfigError, from_dict, validate_training
from megareason.config.schema import Config
from megareason.data.records import PromptRecord, TokenizedPrompt
from megareason.data.sampler import PromptSampler
from megareason.rewards.custom import load_custom
from megareason.rewards.registry import RewardOutput
from megareason.rollout.records import Completion
from megareason.trainer.experience import build_experience, pack_experience, unpack_to_rows
from megareason.trainer.run_dir import RunDir, SamplerState, TrainerState
from megareason.trainer.tracking import Tracker, read_metrics


def _prompt(ids):
    return TokenizedPrompt(PromptRecord([{"role": "user", "content": "q"}], "x", "1"), "q", ids)


def _completion(ids, logps):
    return Completion(token_ids=ids, text="", logprobs_T=logps, finish_reason="stop")


def _experience():
    prompts = [_prompt([1, 2, 3]), _prompt([4, 5])]
    groups = [[_completion([7, 8], [-0.5, -0.25]), _completion([9], [-1.0])],
              [_completion([10, 11, 12], [-0.1, -0.2, -0.3]), _completion([13, 14], [-2.0, -3.0])]]
    return build_experience(prompts, groups)


def test_build_experience_lays_prompt_then_response_with_aligned_logprobs():
    exp = _experience()
    assert exp.lengths_B.tolist() == [5, 4, 5, 4]
    assert exp.tokens_BT.tolist() == [[1, 2, 3, 7, 8], [1, 2, 3, 9, 0], [4, 5, 10, 11, 12], [4, 5, 13, 14, 0]]
    assert exp.mask_BT.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 0]]
    # column t holds the log-prob of token t
    assert exp.rollout_logp_BT[0].tolist() == [0, 0, 0, -0.5, -0.25]
    assert exp.rollout_logp_BT[3].tolist() == [0, 0, -2.0, -3.0, 0]
    sub = exp.select([1, 3])
    assert sub.tokens_BT.tolist() == [[1, 2, 3, 9], [4, 5, 13, 14]]  # trimmed to the longest selected row


def test_pack_then_unpack_gives_back_every_row():
    exp = _experience()
    micro = pack_experience(exp, micro_batch_tokens=9, names=["rollout_logp_BT", "mask_BT"])
    assert len(micro) == 2 and {m.tokens_BT.shape for m in micro} == {(1, 9)}
    assert sorted(i for m in micro for i in m.index) == [0, 1, 2, 3]
    for name in ("rollout_logp_BT", "mask_BT"):
        back = unpack_to_rows([m.fields[name] for m in micro], micro, exp.lengths_B, exp.tokens_BT.shape[1])
        assert torch.equal(back, getattr(exp, name))
    tokens = unpack_to_rows([m.tokens_BT for m in micro], micro, exp.lengths_B, exp.tokens_BT.shape[1])
    assert torch.equal(tokens, exp.tokens_BT)


def test_prompt_sampler_is_a_permutation_per_epoch_and_resumes_exactly():
    s = PromptSampler(5, seed=3)
    first = s.next(5)
    assert sorted(first) == [0, 1, 2, 3, 4]
    straight = [s.next(3) for _ in range(4)]
    r = PromptSampler(5, seed=3)
    r.next(5)
    r.next(3)
    resumed = PromptSampler(5, seed=3, epoch=r.epoch, position=r.position)
    assert [resumed.next(3) for _ in range(3)] == straight[1:]
    assert PromptSampler(5, seed=4).next(5) != first or PromptSampler(5, seed=5).next(5) != first


def test_run_dir_sees_only_complete_checkpoints_and_keeps_the_last_k(tmp_path):
    run = RunDir(tmp_path)
    assert run.latest() is None
    for step in (1, 2, 3):
        tmp = run.begin_checkpoint(step)
        (tmp / "actor").mkdir()
        run.commit_checkpoint(tmp, TrainerState(step=step, sampler=SamplerState(1, step)), keep_last=2)
    run.begin_checkpoint(4)  # a crash mid-save: the temporary folder stays behind
    (run.checkpoints / "step_00000005").mkdir()  # no trainer_state.json: incomplete
    assert run.steps() == [2, 3]
    assert run.latest().name == "step_00000003"
    assert run.read_state(run.latest()) == TrainerState(step=3, sampler=SamplerState(1, 3))


def test_tracker_drops_records_after_the_resumed_step(tmp_path):
    t = Tracker(tmp_path, ["console"], start_step=0)
    for step in (1, 2, 3):
        t.log(step, {"loss": float(step), "nan": float("nan")})
    t.close()
    t = Tracker(tmp_path, [], start_step=2)  # resumed from the step-2 checkpoint
    t.log(3, {"loss": 30.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert "nan" not in read_metrics(tmp_path)[0]


def _cfg(**sections) -> Config:
    raw = {"data": {"sources": [{"kind": "reasoning_gym", "name": "basic_arithmetic", "size": 4}]}}
    raw.update(sections)
    return from_dict(raw)


def test_grpo_advantages_by_hand():
    exp = _experience()  # two groups of two samples
    cfg = _cfg(rollout={"n": 2})
    out = compute_advantages(cfg.algorithm, cfg.raro, exp.with_fields(), torch.tensor([1.0, 0.0, 0.5, 0.5]),
                             torch.tensor([0, 0, 1, 1]))
    # group 0: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / sqrt(0.5) on each response token;
    # group 1: all equal -> 0
    a = 0.5 / (2**-0.5 + 1e-6)
    expected = torch.tensor([[0, 0, 0, a, a], [0, 0, 0, -a, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert torch.allclose(out["adv_BT"], expected, atol=1e-6)


def test_ppo_puts_the_reward_on_the_last_response_token_and_runs_gae():
    exp = _experience()
    values = torch.rand(exp.tokens_BT.shape, generator=torch.Generator().manual_seed(0))
    exp = exp.with_fields(values_BT=values)
    cfg = _cfg(algorithm={"name": "ppo", "gamma": 0.9, "lam": 0.8, "whiten_advantages": False})
    reward = torch.tensor([1.0, 0.0, 0.5, 2.0])
    out = compute_advantages(cfg.algorithm, cfg.raro, exp, reward, torch.arange(4) // 2)
    token_reward = torch.zeros_like(exp.mask_BT)
    for b, last in enumerate([4, 3, 4, 3]):  # the last response token of each row, by hand
        token_reward[b, last] = reward[b]
    adv, ret = gae_reference(token_reward, values, exp.mask_BT, gamma=0.9, lam=0.8)
    assert torch.allclose(out["adv_BT"], adv, atol=1e-6) and torch.allclose(out["returns_BT"], ret, atol=1e-6)


@pytest.mark.parametrize("sections, field", [
    ({"trainer": {"prompts_per_step": 3}, "rollout": {"n": 3}, "algorithm": {"mini_batches": 2}},
     "trainer.prompts_per_step"),
    ({"trainer": {"prompts_per_step": 2}, "parallel": {"data_parallel_size": 3}}, "trainer.prompts_per_step"),
    ({"trainer": {"micro_batch_tokens": 100}}, "trainer.micro_batch_tokens"),
    ({"rollout": {"n": 1}}, "rollout.n"),
    ({"algorithm": {"kl_in_reward": True}}, "algorithm.kl_in_reward"),
    ({"algorithm": {"dual_clip": 0.5}}, "algorithm.dual_clip"),
])
def test_training_config_errors_name_the_field(sections, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_training(_cfg(**sections))


def test_custom_reward_from_a_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(data_source, response, ground_truth, extra_info):\n"
                 "    return float(response.count('a')) / 2\n"
                 "def bad(response):\n    return 0\n")
    scorer = load_custom(f"{f}:score")
    assert scorer("x", "aab", "", {}) == RewardOutput(score=1.0, correct=True)
    assert scorer("x", "b", "", {}) == RewardOutput(score=0.0, correct=False)
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_custom(f"{f}:nope")
    with pytest.raises(ValueError, match="must take"):
        load_custom(f"{f}:bad")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_custom(f"{tmp_path}/missing.py:score")
    with pytest.raises(ValueError, match="file.py:function"):
        load_custom("no_colon")


def test_trainer_state_round_trips_through_json(tmp_path):
    state = TrainerState(step=7, sampler=SamplerState(2, 5), extra={"buffer": "replay.pt"})
    from dataclasses import asdict

    assert TrainerState.from_json(json.dumps(asdict(state))) == state


def test_an_unknown_data_source_fails_at_start_up_listing_the_registered_ones():
    from megareason.data import DataError
    from megareason.rewards.scoring import scorer_from

    records = [PromptRecord([{"role": "user", "content": "q"}], src, "1") for src in ("math", "no_such_source")]
    with pytest.raises(DataError, match=r"no_such_source.*registered: .*countdown.*gsm8k"):
        scorer_from(_cfg().reward, records)
    assert scorer_from(_cfg().reward, records[:1])("math", "\\boxed{1}", "1", {}).correct


def test_dapo_overlong_shaping_and_truncation_mask_on_a_steps_rows():
    from megareason.config import load_config
    from megareason.rewards.scoring import SampleResult
    from megareason.rollout.records import Completion
    from megareason.trainer.steps import SingleTurn

    cfg = load_config("grpo_smollm2_cpu", ["rollout.n=2", "rollout.max_tokens=10", "algorithm.overlong_buffer=4",
                                           "algorithm.overlong_penalty=0.5", "algorithm.mask_truncated=true"])
    prompt = TokenizedPrompt(record=None, text="", token_ids=[1, 2])
    # responses of 6 tokens (stopped: no penalty, <= 10 - 4) and 10 tokens (cut at max_tokens: -0.5, masked)
    group = [Completion(token_ids=[3] * n, text="", logprobs_T=[], finish_reason=f) for n, f in ((6, "stop"),
                                                                                                 (10, "length"))]
    scored = [SampleResult(index=0, sample=j, data_source="d", question="q", ground_truth="g", response="",
                           reward=1.0, correct=True, response_tokens=len(c.token_ids), truncated=c.truncated)
              for j, c in enumerate(group)]
    rows = SingleTurn(cfg, None, None, None)._rows([prompt], [group], scored)
    assert rows.reward_B.tolist() == [1.0, 0.5] and rows.metrics["dapo/overlong_penalty"] == -0.25
    assert rows.exp.mask_BT.sum(dim=1).tolist() == [6.0, 0.0] and rows.group_B.tolist() == [0, 0]


@pytest.mark.parametrize("override, field", [
    ("algorithm.rollout_tis_cap=0.5", "algorithm.rollout_tis_cap"),
    ("algorithm.rollout_mis_cap=1", "algorithm.rollout_mis_cap"),
    ("algorithm.overlong_buffer=99999", "algorithm.overlong_buffer"),
    ("algorithm.dynamic_sampling_max_tries=0", "algorithm.dynamic_sampling_max_tries"),
    ("algorithm.kl_loss_coef=0.01", "algorithm.kl_loss_coef"),  # without kl_in_reward: kl_coef is the loss's
])
def test_bad_algorithm_options_name_their_field(override, field):
    from megareason.config import load_config

    with pytest.raises(ConfigError, match=field):
        validate_training(load_config("grpo_smollm2_cpu", [override]))


def test_dynamic_sampling_is_refused_where_groups_have_no_rewards_of_their_own():
    from megareason.config import load_config

    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling"):
        validate_training(load_config("raro_smollm2_cpu", ["algorithm.dynamic_sampling=true"]))


class _DiskRole:
    """A trained role that writes its checkpoint like a model does; ``full``: the disk fills up mid-write."""

    name, full, loaded = "actor", False, ""

    def save(self, path: str, meta: dict) -> None:
        import errno
        from pathlib import Path

        Path(path).mkdir(parents=True)
        (Path(path) / "model.pt").write_text(f"weights of step {meta['step']}")
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "optimizer.pt"))

    def load(self, path: str) -> None:
        from pathlib import Path

        self.loaded = (Path(path) / "model.pt").read_text()

    def sync_weights(self) -> None:
        pass

    def stop_generating_on(self, path: str) -> None:
        pass  # no engine


def test_a_full_disk_while_a_checkpoint_is_written_keeps_the_last_complete_one(tmp_path):
    from megareason.config import load_config
    from megareason.trainer.driver import Driver
    from megareason.trainer.run_dir import CheckpointError

    cfg = load_config("grpo_smollm2_cpu", [f"trainer.output_dir={tmp_path}", "trainer.save_every=2", "trainer.steps=4",
                                           "trainer.val_before_train=false"])
    role = _DiskRole()
    driver = Driver(cfg, RunDir(tmp_path), [role], 16, "training", None)
    driver.start()
    for step, _ in driver.steps():
        role.full = step == 4
        if step < 4:
            driver.end_step(step, {"loss": float(step)})
            continue
        with pytest.raises(CheckpointError, match=r"step 4 could not be written .*No space left on device.*"
                                                  r"optimizer\.pt.*the last complete one is .*step_00000002"):
            driver.end_step(step, {"loss": 4.0})
        break
    driver.close()
    assert RunDir(tmp_path).steps() == [2]  # the half-written step 4 never counts
    # Space freed: the next run resumes from step 2's checkpoint and saves step 4, the leftover cleared.
    again = _DiskRole()
    resumed = Driver(cfg, RunDir(tmp_path), [again], 16, "training", None)
    assert resumed.start().step == 2 and again.loaded == "weights of step 2"
    for step, _ in resumed.steps():
        resumed.end_step(step, {"loss": float(step)})
    resumed.close()
    assert RunDir(tmp_path).steps() == [2, 4] and not list((tmp_path / "checkpoints").glob(".*.tmp"))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


class _BackgroundRole(_DiskRole):
    """A role whose asynchronous save writes its files only when ``finish_saves`` finds the write done
    (``ready``; ``blocking`` waits for it); ``fails``: the background write fails."""

    ready, fails, pending = False, False, None

    def save(self, path: str, meta: dict, asynchronous: bool = False) -> None:
        if asynchronous:
            self.pending = (path, meta)
        else:
            super().save(path, meta)

    def finish_saves(self, blocking: bool) -> bool:
        if self.pending is None:
            return True
        if not (blocking or self.ready):
            return False
        if self.fails:
            self.pending = None
            raise OSError(5, "Input/output error", "the writer's file")
        path, meta = self.pending
        self.pending = None
        super().save(path, meta)
        return True


def test_a_checkpoint_written_in_the_background_counts_once_written_and_a_failed_one_never(tmp_path):
    """trainer.async_save: the step-2 checkpoint becomes step_2 only once its roles report the write done
    (checked after each step, without waiting), holding the state after step 2; the next save waits for it;
    the last step's is written at once; keep_last prunes as usual. A background write that fails raises at
    the check, naming the last complete checkpoint, and leaves no step folder."""
    from megareason.config import load_config
    from megareason.trainer.driver import Driver
    from megareason.trainer.run_dir import CheckpointError

    def config(out):
        return load_config("grpo_smollm2_cpu", [f"trainer.output_dir={out}", "trainer.save_every=2", "trainer.steps=5",
                                               "trainer.val_before_train=false", "trainer.async_save=true",
                                               "trainer.keep_last=2"])

    run, role = RunDir(tmp_path / "a"), _BackgroundRole()
    driver = Driver(config(run.root), run, [role], 16, "training", None)
    driver.start()
    seen = {}
    for step, _ in driver.steps():
        role.ready = step >= 4  # step 2's write is still going on after step 3
        driver.end_step(step, {"loss": float(step)})
        seen[step] = run.steps()
    driver.close()
    assert seen == {1: [], 2: [], 3: [], 4: [2], 5: [4, 5]}
    assert (run.checkpoint(4) / "actor" / "model.pt").read_text() == "weights of step 4"
    # the same trainer state as a run that saves at once writes for step 4
    sync = RunDir(tmp_path / "sync")
    at_once = Driver(load_config("grpo_smollm2_cpu", [f"trainer.output_dir={sync.root}", "trainer.save_every=2",
                                                      "trainer.steps=5", "trainer.val_before_train=false"]),
                     sync, [_DiskRole()], 16, "training", None)
    at_once.start()
    for step, _ in at_once.steps():
        at_once.end_step(step, {"loss": float(step)})
    at_once.close()
    assert run.read_state(run.checkpoint(4)) == sync.read_state(sync.checkpoint(4))
    assert run.read_state(run.checkpoint(4)).step == 4

    run, role = RunDir(tmp_path / "b"), _BackgroundRole()
    role.fails = True
    driver = Driver(config(run.root), run, [role], 16, "training", None)
    driver.start()
    with pytest.raises(CheckpointError, match=r"step 2 could not be written .*Input/output error.*the last complete "
                                              r"one is none"):
        for step, _ in driver.steps():
            role.ready = step >= 3
            driver.end_step(step, {"loss": float(step)})
    assert run.steps() == [] and not run.checkpoint(2).exists()


def test_sigterm_during_validation_finishes_it_saves_and_exits_75(tmp_path):
    """The SIGTERM arrives while step 2's validation runs (a real signal to this process): a validation that
    generates nothing completes, its metrics are logged, the step is checkpointed and the run exits with
    EXIT_STOPPED (one whose engines generate gives up instead: tests/test_engine_state.py)."""
    import os
    import signal

    from megareason.config import load_config
    from megareason.trainer.driver import EXIT_STOPPED, Driver, stop_signals

    cfg = load_config("grpo_smollm2_cpu", [f"trainer.output_dir={tmp_path}", "trainer.save_every=0", "trainer.steps=4",
                                           "trainer.val_every=2", "trainer.val_before_train=false"])

    def validate(step: int) -> dict[str, float]:
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"val/accuracy": step / 10}

    role = _DiskRole()
    with stop_signals() as stop:
        driver = Driver(cfg, RunDir(tmp_path), [role], 16, "training", validate, stop)
        driver.start()
        with pytest.raises(SystemExit) as stopped:
            for step, _ in driver.steps():
                driver.end_step(step, {"loss": float(step)})
    assert stopped.value.code == EXIT_STOPPED
    assert RunDir(tmp_path).steps() == [2]
    assert [(r["step"], r.get("val/accuracy")) for r in read_metrics(tmp_path)] == [(1, None), (2, 0.2)]


def test_worker_settings_hold_what_the_workers_use_and_no_config():
    """What a Ray worker receives: the policy's and the critic's settings, each one picklable record with
    no ``Config`` inside (only its algorithm section), built from the config's own fields."""
    import dataclasses
    import pickle

    from megareason.config.schema import Config
    from megareason.trainer.handles import critic_settings, policy_settings

    cfg = _cfg(optim={"lr": 2e-6, "critic_lr": 3e-5}, rollout={"tensor_parallel_size": 2},
               parallel={"tensor_model_parallel_size": 2}, trainer={"offload_optimizer": True})

    def walk(x):
        yield x
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                yield from walk(getattr(x, f.name))

    policy, critic = policy_settings(cfg), critic_settings(cfg)
    for s in (policy, critic):
        assert not any(isinstance(x, Config) for x in walk(s))
        assert pickle.loads(pickle.dumps(s)) == s
    assert (policy.optimizer.lr, critic.optimizer.lr) == (2e-6, 3e-5)
    assert policy.colocated_engines and policy.offload_optimizer and policy.tensor_parallel == 2
    assert policy.engine.tensor_parallel_size == 2 and policy.algorithm == cfg.algorithm
