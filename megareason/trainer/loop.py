"""``megareason train``: the RL loop, read top to bottom (GRPO, PPO and RARO).

Per step: prompts -> rollouts and their rows (``steps.py``: completions scored by the reward registry,
environment episodes, or RARO's critic round) -> old log-probs (and the train/generation mismatch) ->
reference log-probs (KL) -> critic values (PPO) -> advantages -> mini-batch updates for
algorithm.ppo_epochs -> weight sync into vLLM -> metrics, rollout dump, validation, checkpoint
(``driver.py``: the frame ``megareason sft`` shares). The driver process holds no model: it moves
``Experience`` records between the Ray worker groups (``handles.py``) and runs the pure functions of
``megareason.algorithms``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from megareason.algorithms.estimate import compute_advantages
from megareason.algorithms.raro import role_mini_batches
from megareason.config import Config, ConfigError, validate_training
from megareason.data.loaders import LoadedData, load_data
from megareason.data.prompts import tokenize_prompts
from megareason.data.records import TokenizedPrompt
from megareason.rewards.data_table import TABLE_FILE, data_table
from megareason.rewards.scoring import check_rewards, reward_scorer, score, scoring_pool, summarize
from megareason.rollout.records import GenerationStopped, UpdateStopped
from megareason.settings import policy_data
from megareason.trainer.driver import Driver, StopRequest, dump_validation, greedy, learning_rate, stop_signals, timed
from megareason.trainer.episodes import check_env_data, env_enabled, run_env
from megareason.trainer.experience import Experience
from megareason.trainer.group import WorkerGroup, ray_session
from megareason.trainer.handles import CriticHandle, PolicyHandle, start_rollouts, start_workers
from megareason.trainer.metrics import UpdateStats, step_metrics
from megareason.trainer.offpolicy import OneStepOff
from megareason.trainer.pool import RolloutPool
from megareason.trainer.run_dir import RunDir, hold_run_lock
from megareason.trainer.steps import ScoreFn, StepRows, rollout_step
from megareason.utils import atomic_write

log = logging.getLogger(__name__)


def train(cfg: Config) -> Path:
    """Run (or resume) training as configured; returns the run folder."""
    validate_training(cfg)
    hold_run_lock(cfg.trainer.output_dir)
    run = RunDir(cfg.trainer.output_dir)
    run.check_resume(cfg)  # a resume with a changed config is refused here, before anything is loaded
    # A bad reward file, bad data, an unknown data_source or a missing model fail here, before Ray starts;
    # the data's table (which reward scores which source, the validation set, the first prompt) is shown.
    scorer = reward_scorer(cfg.reward)
    prompts, val_prompts, tokenizer, data = _load_prompts(cfg)
    check_rewards(cfg.reward, scorer, [p.record for p in prompts + val_prompts])
    table = data_table(data, scorer, prompts[0].text)
    log.info("%s", table)
    atomic_write(run.root / TABLE_FILE, table + "\n")
    if env_enabled(cfg):
        check_env_data(cfg, [p.record for p in prompts + val_prompts])
    with scoring_pool(cfg.reward, scorer) as pool, ray_session(cfg.trainer.ray_address), stop_signals() as stop:
        groups, engines = start_workers(cfg, with_critic=cfg.algorithm.name == "ppo"), None
        try:
            engines = start_rollouts(cfg, groups)
            score_fn = partial(score, scorer=scorer, pool=pool, tinyv=cfg.reward.tinyv,
                               max_error_rate=cfg.reward.max_error_rate)
            _train_loop(cfg, run, groups, prompts, val_prompts, score_fn, tokenizer, stop, engines)
        finally:
            for g in groups + ([engines] if engines else []):
                g.shutdown()
    return run.root


def _train_loop(cfg: Config, run: RunDir, groups: list[WorkerGroup], prompts: list[TokenizedPrompt],
                val_prompts: list[TokenizedPrompt], score_fn: ScoreFn, tokenizer=None,
                stop: StopRequest | None = None, engines: RolloutPool | None = None) -> None:
    t, alg = cfg.trainer, cfg.algorithm
    actors = PolicyHandle(groups[0], engines)
    critic = CriticHandle(groups[1]) if len(groups) > 1 else None
    # One update per rollout and no KL in the reward: the update's own forward pass gives the old
    # log-probs (detached) and the train/generation mismatch, so no separate pass is needed.
    on_policy = alg.ppo_epochs == 1 and alg.mini_batches == 1 and not (alg.kl_in_reward and alg.kl_coef > 0)
    val = partial(validate, actors, val_prompts, cfg, score_fn, tokenizer, run.root) if val_prompts else None
    driver = Driver(cfg, run, [actors] + ([critic] if critic else []), len(prompts), "training", val, stop)
    # Resume (every role's checkpoint loaded, the engines given its weights), or validate before training.
    state = driver.start()
    rollout = rollout_step(cfg, actors, score_fn, tokenizer, state.extra,
                           more=partial(_next_prompts, prompts, driver.sampler, t.prompts_per_step))
    if t.max_staleness:
        rollout = OneStepOff(cfg, rollout, actors, prompts, driver.sampler.peek, state.step, driver.resumed_from,
                             driver.resume_syncs)

    for step, indices in driver.steps():
        timer: dict[str, float] = {}
        # 1. generate and score (one step off: wait for this step's batch, push the weights, launch the next)
        try:
            rows = rollout(step, [prompts[i] for i in indices], timer)
        except GenerationStopped as e:  # a SIGTERM: the step's samples are dropped, the state before it saved
            driver.drop_step(step, cause=str(e))
        # 2. the engines asleep: log-probs, advantages, the updates; 3. the weight sync wakes the engines
        exp, update, parts = rows.exp, UpdateStats(), mini_batch_rows(cfg, rows)
        if min(map(len, parts)) >= cfg.parallel.data_parallel_size and exp.mask_BT.any():
            try:
                exp, update = _update(cfg, step, actors, critic, rows, parts, on_policy, timer,
                                      sync=not rollout.pushes_weights)
            except UpdateStopped as e:  # a SIGTERM before the step's first optimizer step: the model is unchanged
                driver.drop_step(step, "log-probs or first optimizer step", cause=str(e))
        else:  # every row masked (RARO's critic, DAPO's filters): nothing to learn from this step
            log.warning("step %d: only %d trainable rows; the update is skipped", step, len(exp))
        update.sync = update.sync or rows.sync  # one step off: the variant's push before this step's batch
        timer["step"] = sum(timer.values())
        metrics = step_metrics(cfg, step, exp, rows, update, timer)
        for role in [actors] + ([critic] if critic else []):  # on GPU: each phase's real memory beside the plan
            metrics.update(role.memory_by_phase())
        if t.dump_rollouts_every and step % t.dump_rollouts_every == 0:
            _dump_rollouts(run.root, step, rows)
        # 4. validation (one step off: the batch in flight done and the newest weights pushed first)
        if driver.validation_due(step):
            rollout.before_validation(step)
            driver.validate_step(step, metrics, rollout.state())
        # 5. the metrics, a checkpoint when due (the engines asleep: PolicyWorker.save), a stop when asked
        driver.finish_step(step, metrics, rollout.state(), save_files=rollout.save_files)
    driver.close()


def _next_prompts(prompts: list[TokenizedPrompt], sampler, n: int) -> list[TokenizedPrompt]:
    """The next ``n`` prompts of the run's order (DAPO's dynamic sampling draws them within a step)."""
    return [prompts[i] for i in sampler.next(n)]


def mini_batch_rows(cfg: Config, rows: StepRows) -> list[torch.Tensor]:
    """The rows of each of the step's algorithm.mini_batches optimizer steps: contiguous parts, or under
    RARO a share of each role in every part (``algorithms.raro.role_mini_batches``)."""
    n, m = len(rows.exp), cfg.algorithm.mini_batches
    if rows.is_critic_B is not None:
        return role_mini_batches(rows.is_critic_B, m)
    return [torch.arange(n * i // m, n * (i + 1) // m) for i in range(m)]


def _update(cfg: Config, step: int, actors: PolicyHandle, critic: CriticHandle | None, rows: StepRows,
            parts: list[torch.Tensor], on_policy: bool, timer: dict[str, float], sync: bool = True
            ) -> tuple[Experience, UpdateStats]:
    """Log-probs (old, reference, critic values) -> advantages -> ppo_epochs x len(parts) updates (``parts``:
    ``mini_batch_rows``) -> weight sync (``sync``; one step off-policy pushes the weights when the engines
    are idle: ``offpolicy``). Returns the completed experience and what the workers reported; raises
    ``UpdateStopped`` when a stop ends a pass before the first optimizer step."""
    alg, exp, update = cfg.algorithm, rows.exp, UpdateStats()
    # The rollout engines free the devices while Megatron computes; the sync at the end wakes them.
    actors.sleep_engine()
    with timed(timer, "logprobs"):
        if not on_policy:
            exp = exp.with_fields(old_logp_BT=actors.logprobs(exp)[0])
        if alg.kl_coef > 0:
            exp = exp.with_fields(ref_logp_BT=actors.ref_logprobs(exp))
        if critic is not None:
            exp = exp.with_fields(values_BT=critic.values(exp))

    exp = exp.with_fields(**compute_advantages(cfg.algorithm, cfg.raro, exp, rows.reward_B, rows.group_B,
                                               rows.is_critic_B, parts))

    # A SIGTERM stops the log-prob passes and the first optimizer step's pass between pieces of their
    # micro-batches (``UpdateStopped``: the step is dropped, the state before it saved). From the first
    # optimizer step on, the model holds part of the step: the remaining updates and the sync run to the end,
    # and the checkpoint after the step is saved (with algorithm.ppo_epochs x mini_batches updates a step).
    with timed(timer, "train"):
        for epoch in range(alg.ppo_epochs):
            for b, rows_b in enumerate(parts):
                mini, first = exp.select(rows_b), epoch == 0 and b == 0
                lr = learning_rate(cfg.optim.lr, cfg, step)
                update.actor.append(actors.train(mini, lr, on_policy, stoppable=first))
                if critic is not None:
                    update.critic.append(critic.train(mini, learning_rate(cfg.optim.critic_lr, cfg, step)))
    if sync:
        with timed(timer, "sync"):
            update.sync = actors.sync_weights()
    return exp, update


def validate(actors: PolicyHandle, val_prompts: list[TokenizedPrompt], cfg: Config, score_fn: ScoreFn,
             tokenizer=None, root: Path | None = None, step: int = 0) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts, overall and per data_source (episodes under an env); the
    samples go to ``root/rollouts/val_step_N.jsonl`` when ``root`` is given."""
    completions = None
    if env_enabled(cfg):
        _, _, results = run_env(cfg, val_prompts, actors.generate_ids, tokenizer, greedy(cfg))
    else:
        completions = actors.generate(val_prompts, greedy(cfg))
        results = score_fn(val_prompts, completions)
    if root is not None:
        dump_validation(root, step, val_prompts, results, completions)
    out = {"val/accuracy": sum(r.correct for r in results) / len(results),
           "val/reward": sum(r.reward for r in results) / len(results)}
    for s in summarize(results, 1, [1]):
        out[f"val/by_source/{s.data_source}/accuracy"] = s.accuracy
    return out


def _dump_rollouts(root: Path, step: int, rows: StepRows) -> None:
    """The step's scored samples (``rollouts/step_N.jsonl``) and RARO's judgements (``..._critic.jsonl``)."""
    folder = root / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"step_{step:08d}.jsonl", "".join(json.dumps(asdict(s)) + "\n" for s in rows.scored))
    if rows.judgements:
        atomic_write(folder / f"step_{step:08d}_critic.jsonl", "".join(json.dumps(r) + "\n" for r in rows.judgements))


def _load_prompts(cfg: Config) -> tuple[list[TokenizedPrompt], list[TokenizedPrompt], object, LoadedData]:
    from transformers import AutoTokenizer

    from megareason.models.build import HFCheckpoint
    from megareason.models.hub import resolve_model_path

    path = resolve_model_path(cfg.model.path)
    p = cfg.parallel
    arch = HFCheckpoint(path).arch
    arch.check_parallelism(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size)
    if arch.is_moe and cfg.lora.enabled:
        raise ConfigError(f"{path}: LoRA on a mixture-of-experts model is not supported (lora.enabled=true)")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer
                                                  else path))
    d = policy_data(cfg)
    data = load_data(d, any_source=bool(cfg.reward.custom or cfg.reward.funcs))
    prompts = tokenize_prompts(data.train, tokenizer, d.max_prompt_length, d.truncation)
    if len(prompts) < cfg.trainer.prompts_per_step:
        raise ConfigError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} but the training data has "
                          f"only {len(prompts)} prompts")
    val = tokenize_prompts(data.val, tokenizer, d.max_prompt_length, d.truncation) if data.val else []
    return prompts, val, tokenizer, data
