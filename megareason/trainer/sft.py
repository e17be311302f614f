"""``megareason sft``: supervised fine-tuning on demonstrations, with the RL loop's machinery.

The same Megatron actor (``PolicyWorker`` over Ray, any TP/PP/DP), the same packing into micro-batches
of ``trainer.micro_batch_tokens`` tokens (samples of one prompt share it), checkpoints, resume, metrics
and greedy validation through vLLM (after a weight sync). The loss is the token-mean negative
log-likelihood of the response tokens only (``algorithm.loss_agg_mode`` applies, exact under any split).

A demonstration is a record whose chat ends with the assistant's answer (that message is the
response), or a seed/reasoning-gym record: the response is ``sft.response_template`` filled with the
record's ``solution`` (the expert's reasoning, may be empty) and ``answer`` (``extra_info
["expert_answer"]`` when set, else ``ground_truth``). Per step: ``trainer.prompts_per_step``
demonstrations from a seeded, resumable order; ``val/loss`` on the ``data.val_sources`` demonstrations
and ``val/accuracy`` (greedy answers scored by the reward registry) every ``trainer.val_every`` steps.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from megareason.config import Config, ConfigError
from megareason.data.loaders import DataError, load_records
from megareason.data.records import PromptRecord, TokenizedPrompt
from megareason.data.sampler import PromptSampler
from megareason.evaluation.runner import score, scorer_from, scoring_pool
from megareason.rollout.engine import Completion, Sampling
from megareason.trainer.experience import Experience, build_experience
from megareason.trainer.group import WorkerGroup, ray_session
from megareason.trainer.run_dir import RunDir, SamplerState, TrainerState
from megareason.trainer.tracking import Tracker
from megareason.trainer.workers import PolicyWorker
from megareason.utils import atomic_write

log = logging.getLogger(__name__)


def demonstration(record: PromptRecord, template: str, where: str) -> tuple[list[dict[str, str]], str]:
    """(prompt messages, response text) of one demonstration record."""
    if record.prompt and record.prompt[-1]["role"] == "assistant":
        if len(record.prompt) < 2:
            raise DataError(f"{where}: a chat demonstration needs a message before the assistant's answer")
        return record.prompt[:-1], record.prompt[-1]["content"]
    info = record.extra_info
    answer = str(info.get("expert_answer", record.ground_truth))
    if not answer.strip():
        raise DataError(f"{where}: no answer to imitate (empty ground truth / expert_answer)")
    try:
        return record.prompt, template.format(solution=str(info.get("solution", "")).strip(), answer=answer).strip()
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"sft.response_template {template!r}: {e}; it may use {{solution}} and {{answer}} "
                          "(write {{ and }} for literal braces)") from None


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
    t = cfg.trainer
    path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer
                                                  else path))
    template, max_len = cfg.sft.response_template, cfg.rollout.max_model_len
    train_set = tokenize_demonstrations(load_records(cfg.data), tokenizer, template, max_len, "training data")
    val_set = None
    if cfg.data.val_sources:
        val_set = tokenize_demonstrations(load_records(replace(cfg.data, sources=cfg.data.val_sources)), tokenizer,
                                          template, max_len, "validation data")
    if len(train_set[0]) < t.prompts_per_step:
        raise ConfigError(f"trainer.prompts_per_step={t.prompts_per_step} but the training data has only "
                          f"{len(train_set[0])} demonstrations")
    scorer = scorer_from(cfg, [p.record for p in train_set[0] + (val_set[0] if val_set else [])])
    run = RunDir(t.output_dir)
    with scoring_pool(cfg, scorer) as pool, ray_session(t.ray_address):
        from megareason.trainer.loop import _check_cluster

        _check_cluster(cfg)
        p = cfg.parallel
        world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
        actors = WorkerGroup(PolicyWorker, cfg, "actor", 1.0 if torch.cuda.is_available() else 0,
                             max(1, (os.cpu_count() or 1) // world))
        try:
            _loop(cfg, run, actors, train_set, val_set, partial(score, scorer=scorer, pool=pool))
        finally:
            actors.shutdown()
    return run.root


def _loop(cfg: Config, run: RunDir, actors: WorkerGroup, train_set, val_set, score_fn) -> None:
    from megareason.trainer.loop import _generate, _lr, dump_validation

    t = cfg.trainer
    state = TrainerState()
    latest = run.latest() if t.resume_mode == "auto" else None
    if latest is not None:
        state = run.read_state(latest)
        log.info("resuming from %s (step %d)", latest, state.step)
        actors.call("load", str(latest / "actor"))
    run.root.mkdir(parents=True, exist_ok=True)
    atomic_write(run.root / "config.json", json.dumps(asdict(cfg), indent=2) + "\n")
    sampler = PromptSampler(len(train_set[0]), t.seed, state.sampler.epoch, state.sampler.position)
    tracker = Tracker(run.root, t.loggers, state.step, config=asdict(cfg))

    def validate(step: int) -> dict[str, float]:
        if val_set is None:
            return {}
        prompts, responses = val_set
        exp = _experience(prompts, responses, list(range(len(prompts))))
        actors.call("sleep_engine")  # Megatron computes; the sync below wakes the engines
        logp, _ = (torch.cat(x) for x in zip(*actors.replicas(actors.call("logprobs", exp)), strict=True))
        out = {"val/loss": float(-(logp * exp.mask_BT).sum() / exp.mask_BT.sum())}
        actors.call("sync_weights")  # vLLM answers with the current weights
        greedy = Sampling(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens, stop=tuple(cfg.rollout.stop))
        completions = _generate(actors, prompts, greedy)
        results = score_fn(prompts, completions)
        dump_validation(run.root, step, prompts, results, completions)
        out["val/accuracy"] = sum(r.correct for r in results) / len(results)
        out["val/reward"] = sum(r.reward for r in results) / len(results)
        return out

    if t.val_before_train and state.step == 0:
        tracker.log(0, validate(0))
    for step in tqdm(range(state.step + 1, t.steps + 1), desc="sft", unit="step", initial=state.step,
                     total=t.steps):
        rows = sampler.next(t.prompts_per_step)
        exp = _experience(*train_set, rows)
        lr = _lr(cfg.optim.lr, cfg, step)
        actors.call("sleep_engine")  # after a validation's generate; else already asleep (no-op)
        stats = actors.call("sft_train", exp, lr)[0]
        metrics = {"sft/loss": stats["nll_num"] / max(stats["nll_den"], 1), "sft/grad_norm": stats["grad_norm"],
                   "sft/lr": lr, "sft/tokens": stats["tokens"]}
        if step == t.steps or (t.val_every and step % t.val_every == 0):
            metrics.update(validate(step))
        tracker.log(step, metrics)
        if step == t.steps or (t.save_every and step % t.save_every == 0):
            tmp = run.begin_checkpoint(step)
            actors.call("save", str(tmp / "actor"), {"step": step})
            run.commit_checkpoint(tmp, TrainerState(step=step, sampler=SamplerState(sampler.epoch, sampler.position)),
                                  t.keep_last)
    tracker.close()
