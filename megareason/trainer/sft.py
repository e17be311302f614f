"""``megareason sft``: supervised fine-tuning on demonstrations, with the RL loop's machinery.

The same Megatron actor (``PolicyWorker`` over Ray, any TP/PP/DP), the same packing into micro-batches
of ``trainer.micro_batch_tokens`` tokens (samples of one prompt share it), checkpoints, resume, metrics
and greedy validation through vLLM (after a weight sync). The loss is the token-mean negative
log-likelihood of the response tokens only (``algorithm.loss_agg_mode`` applies, exact under any split).

A demonstration is a record whose chat ends with the assistant's answer (that message is the
response), or a question/answer or reasoning-gym record: the response is ``sft.response_template`` filled with the
record's ``solution`` (the expert's reasoning, may be empty) and ``answer`` (``extra_info
["expert_answer"]`` when set, else ``ground_truth``). Per step: ``trainer.prompts_per_step``
demonstrations from a seeded, resumable order; ``val/loss`` on the ``data.val_sources`` demonstrations
and ``val/accuracy`` (greedy answers scored by the reward registry) every ``trainer.val_every`` steps.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path

from megareason.config import Config, ConfigError
from megareason.data.loaders import load_data
from megareason.data.prompts import demonstration
from megareason.data.records import DataError, PromptRecord, TokenizedPrompt
from megareason.rewards.scoring import score, scorer_from, scoring_pool
from megareason.rollout.records import Completion
from megareason.trainer.driver import Driver, StopRequest, dump_validation, greedy, learning_rate, stop_signals
from megareason.trainer.experience import Experience, build_experience
from megareason.trainer.group import WorkerGroup, ray_session
from megareason.trainer.handles import PolicyHandle, start_workers
from megareason.trainer.run_dir import RunDir, hold_run_lock

log = logging.getLogger(__name__)


def tokenize_demonstrations(records: list[PromptRecord], tokenizer, template: str, max_len: int,
                            what: str) -> tuple[list[TokenizedPrompt], list[Completion]]:
    """Prompts (chat template + generation header) and responses (answer tokens + EOS); demonstrations
    longer than ``max_len`` tokens in all are dropped (counted in a warning)."""
    prompts, responses, dropped = [], [], 0
    for rec in records:
        where = f"{what} row {rec.extra_info.get('index', '?')}"
        messages, text = demonstration(rec, template, where)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        response = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(ids) + len(response) > max_len:
            dropped += 1
            continue
        prompts.append(TokenizedPrompt(record=replace(rec, prompt=messages), text="", token_ids=ids))
        responses.append(Completion(token_ids=response, text=text, logprobs_T=[], finish_reason="stop"))
    if dropped:
        log.warning("%s: dropped %d of %d demonstrations longer than rollout.max_model_len=%d tokens", what,
                    dropped, len(records), max_len)
    if not prompts:
        raise DataError(f"{what}: no demonstration fits rollout.max_model_len={max_len}")
    return prompts, responses


def _experience(prompts: list[TokenizedPrompt], responses: list[Completion], rows: list[int]) -> Experience:
    return build_experience([prompts[i] for i in rows], [[responses[i]] for i in rows])


def sft(cfg: Config) -> Path:
    """Run (or resume) supervised fine-tuning as configured; returns the run folder."""
    from transformers import AutoTokenizer

    from megareason.config import validate_training
    from megareason.models.hub import resolve_model_path

    # Log-probs of the model itself (temperature 1); one update per batch; no reference, no critic.
    cfg = replace(cfg, rollout=replace(cfg.rollout, temperature=1.0),
                  algorithm=replace(cfg.algorithm, kl_coef=0.0, ppo_epochs=1, mini_batches=1))
    validate_training(cfg)
    # Validation's few greedy answers come from a colocated engine; a separate pool is for RL's rollouts.
    cfg = replace(cfg, rollout=replace(cfg.rollout, placement="colocated", num_engines=1))
    t = cfg.trainer
    hold_run_lock(t.output_dir)
    run = RunDir(t.output_dir)
    run.check_resume(cfg)  # a resume with a changed config is refused here, before anything is loaded
    path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer
                                                  else path))
    template, max_len = cfg.sft.response_template, cfg.rollout.max_model_len
    data = load_data(cfg.data, any_source=bool(cfg.reward.custom or cfg.reward.funcs))
    train_set = tokenize_demonstrations(data.train, tokenizer, template, max_len, "training data")
    val_set = None
    if data.val:
        val_set = tokenize_demonstrations(data.val, tokenizer, template, max_len, "validation data")
    if len(train_set[0]) < t.prompts_per_step:
        raise ConfigError(f"trainer.prompts_per_step={t.prompts_per_step} but the training data has only "
                          f"{len(train_set[0])} demonstrations")
    scorer = scorer_from(cfg.reward, [p.record for p in train_set[0] + (val_set[0] if val_set else [])])
    with scoring_pool(cfg.reward, scorer) as pool, ray_session(t.ray_address), stop_signals() as stop:
        (actors,) = start_workers(cfg, with_critic=False)
        try:
            _loop(cfg, run, actors, train_set, val_set, partial(score, scorer=scorer, pool=pool), stop)
        finally:
            actors.shutdown()
    return run.root


def _loop(cfg: Config, run: RunDir, group: WorkerGroup, train_set, val_set, score_fn,
          stop: StopRequest | None = None) -> None:
    actors = PolicyHandle(group)
    val = partial(_validate, cfg, run.root, actors, val_set, score_fn) if val_set is not None else None
    driver = Driver(cfg, run, [actors], len(train_set[0]), "sft", val, stop)
    driver.start()
    for step, rows in driver.steps():
        exp = _experience(*train_set, rows)
        lr = learning_rate(cfg.optim.lr, cfg, step)
        actors.sleep_engine()  # after a validation's generate; else already asleep (no-op)
        stats = actors.sft_train(exp, lr)
        driver.end_step(step, {"sft/loss": stats.means()["nll"], "sft/grad_norm": stats.grad_norm, "sft/lr": lr,
                               "sft/tokens": stats.tokens})
    driver.close()


def _validate(cfg: Config, root: Path, actors: PolicyHandle, val_set, score_fn, step: int) -> dict[str, float]:
    """``val/loss`` (Megatron's NLL of the validation demonstrations), then greedy answers through vLLM after
    a weight sync: ``val/accuracy`` and ``val/reward``."""
    prompts, responses = val_set
    exp = _experience(prompts, responses, list(range(len(prompts))))
    actors.sleep_engine()  # Megatron computes; the sync below wakes the engines
    logp, _ = actors.logprobs(exp)
    out = {"val/loss": float(-(logp * exp.mask_BT).sum() / exp.mask_BT.sum())}
    actors.sync_weights()  # vLLM answers with the current weights
    completions = actors.generate(prompts, greedy(cfg))
    results = score_fn(prompts, completions)
    dump_validation(root, step, prompts, results, completions)
    out["val/accuracy"] = sum(r.correct for r in results) / len(results)
    out["val/reward"] = sum(r.reward for r in results) / len(results)
    return out
