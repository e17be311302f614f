"""``megareason train``: the RL loop, one function read top to bottom (GRPO, PPO and RARO).

Per step: sample prompts -> rollout (rollout.n per prompt, vLLM) -> rewards (RARO: the critic's
verdicts, ``raro.critic``) -> old log-probs (and the
train/generation mismatch) -> reference log-probs (KL) -> critic values (PPO) -> advantages ->
mini-batch updates for algorithm.ppo_epochs -> weight sync into vLLM -> metrics, rollout dump,
validation, checkpoint. The driver holds no model: it moves ``Experience`` records between Ray
worker groups (``workers.py``) and runs the pure functions of ``megareason.algorithms``.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from megareason.algorithms.advantages import broadcast_to_tokens, explained_variance, gae, grpo_advantages, whiten
from megareason.algorithms.kl import kl_in_reward, kl_penalty
from megareason.algorithms.raro import role_advantage_scale
from megareason.config import Config, ConfigError, validate_training
from megareason.data.loaders import load_records
from megareason.data.prompts import tokenize_prompts
from megareason.data.records import TokenizedPrompt
from megareason.data.sampler import PromptSampler
from megareason.envs.runner import check_env_data, env_enabled, run_env
from megareason.evaluation.runner import SampleResult, score, scorer_from, scoring_pool, summarize
from megareason.raro.critic import critic_round
from megareason.raro.prompts import policy_data
from megareason.raro.replay import ReplayBuffer
from megareason.rollout.engine import Sampling
from megareason.rollout.metrics import logprob_mismatch
from megareason.trainer.experience import Experience, build_experience
from megareason.trainer.group import WorkerGroup, cluster_size, ray_session
from megareason.trainer.run_dir import RunDir, SamplerState, TrainerState
from megareason.trainer.tracking import Tracker
from megareason.trainer.workers import CriticWorker, PolicyWorker
from megareason.utils import atomic_write

log = logging.getLogger(__name__)

_REPLAY_FILE = "raro_replay.json"  # RARO's replay buffer, in each checkpoint
# `megareason train`'s exit code when SIGUSR1 or SIGTERM stopped it after a step and a checkpoint: run it
# again to resume (EX_TEMPFAIL). slurm/ray_cluster.sh requeues the job on it.
EXIT_STOPPED = 75

# (prompts, completions per prompt) -> scored samples, in (prompt, sample) order
ScoreFn = Callable[[list[TokenizedPrompt], list[list]], list[SampleResult]]


def train(cfg: Config) -> Path:
    """Run (or resume) training as configured; returns the run folder."""
    validate_training(cfg)
    run = RunDir(cfg.trainer.output_dir)
    # Bad data, an unknown data_source or a missing model fail here, before Ray starts.
    prompts, val_prompts, tokenizer = _load_prompts(cfg)
    scorer = scorer_from(cfg, [p.record for p in prompts + val_prompts])
    if env_enabled(cfg):
        check_env_data(cfg, [p.record for p in prompts + val_prompts])
    with scoring_pool(cfg, scorer) as pool, ray_session(cfg.trainer.ray_address), stop_signals() as stop:
        _check_cluster(cfg)
        groups = _start_workers(cfg)
        try:
            score_fn = partial(score, scorer=scorer, pool=pool, tinyv=cfg.reward.tinyv)
            _train_loop(cfg, run, groups, prompts, val_prompts, score_fn, tokenizer, stop)
        finally:
            for g in groups:
                g.shutdown()
    return run.root


def _train_loop(cfg: Config, run: RunDir, groups: list[WorkerGroup], prompts: list[TokenizedPrompt],
                val_prompts: list[TokenizedPrompt], score_fn: ScoreFn, tokenizer=None,
                stop: StopRequest | None = None) -> None:
    t, alg = cfg.trainer, cfg.algorithm
    actors, critic = groups[0], (groups[1] if len(groups) > 1 else None)
    # One update per rollout and no KL in the reward: the update's own forward pass gives the old
    # log-probs (detached) and the train/generation mismatch, so no separate pass is needed.
    on_policy = alg.ppo_epochs == 1 and alg.mini_batches == 1 and not (alg.kl_in_reward and alg.kl_coef > 0)
    state = TrainerState()
    buffer = ReplayBuffer(cfg.raro.replay_buffer_size, cfg.raro.replay_buffer_kind, t.seed)  # RARO
    latest = run.latest() if t.resume_mode == "auto" else None
    if latest is not None:
        state = run.read_state(latest)
        log.info("resuming from %s (step %d)", latest, state.step)
        for g in groups:
            g.call("load", str(latest / g.name))
        actors.call("sync_weights")  # the engines start from the HF weights
        if alg.name == "raro":
            buffer = ReplayBuffer.from_state(json.loads((latest / _REPLAY_FILE).read_text()))
    run.root.mkdir(parents=True, exist_ok=True)
    atomic_write(run.root / "config.json", json.dumps(asdict(cfg), indent=2) + "\n")
    sampler = PromptSampler(len(prompts), t.seed, state.sampler.epoch, state.sampler.position)
    tracker = Tracker(run.root, t.loggers, state.step, config=asdict(cfg))
    if t.val_before_train and state.step == 0 and val_prompts:
        tracker.log(0, validate(actors, val_prompts, cfg, score_fn, tokenizer, run.root, 0))
    last_save = time.monotonic()  # trainer.save_every_minutes counts from here

    for step in tqdm(range(state.step + 1, t.steps + 1), desc="training", unit="step",
                     initial=state.step, total=t.steps):
        # A stop request while nothing was done since the last checkpoint (or the start): stop now.
        if stop is not None and stop.signal is not None and step == state.step + 1:
            log.warning("%s before step %d: stopped; run again to resume (exit code %d)",
                        signal.Signals(stop.signal).name, step, EXIT_STOPPED)
            tracker.close()
            raise SystemExit(EXIT_STOPPED)
        timer: dict[str, float] = {}
        batch = [prompts[i] for i in sampler.next(t.prompts_per_step)]

        if env_enabled(cfg):  # multi-turn episodes, scored by their environments
            with _timed(timer, "generate"):
                batch, completions, scored = run_env(cfg, batch, partial(_generate_ids, actors), tokenizer,
                                                     _sampling(cfg, step))
        else:
            with _timed(timer, "generate"):
                completions = _generate(actors, batch, _sampling(cfg, step))
            with _timed(timer, "reward"):
                scored = score_fn(batch, completions)  # RARO: monitors accuracy only
        if alg.name == "raro":
            with _timed(timer, "critic"):
                rb = critic_round(cfg.raro, step, t.seed, batch, completions, buffer, tokenizer,
                                  partial(_generate, actors), _sampling(cfg, step),
                                  cfg.rollout.max_model_len - cfg.raro.critic_max_tokens)
            scored = [replace(s, reward=float(r)) for s, r in zip(scored, rb.reward_B, strict=False)]
            # Masked rows (filtered, unjudged, unparseable) leave the batch: they get no gradient.
            keep = rb.keep_B.nonzero().flatten().tolist()
            exp = build_experience(rb.prompts, rb.groups).select(keep)
            reward_B, group_B, is_critic_B = rb.reward_B[keep], rb.group_B[keep], rb.is_critic_B[keep]
        else:
            exp = build_experience(batch, completions)
            reward_B = torch.tensor([s.reward for s in scored])
            group_B = torch.arange(len(exp)) // cfg.rollout.n  # rows are in (prompt, sample) order
            is_critic_B = None

        if len(exp) >= alg.mini_batches * cfg.parallel.data_parallel_size:
            exp, actor_stats, critic_stats, sync = _update(cfg, step, actors, critic, exp, reward_B, group_B,
                                                           is_critic_B, on_policy, timer)
        else:  # RARO, when (nearly) every row was masked: nothing to learn from this step
            log.warning("step %d: only %d trainable rows; the update is skipped", step, len(exp))
            actor_stats, critic_stats, sync = [], [], []

        timer["step"] = sum(timer.values())
        metrics = step_metrics(cfg, step, exp, scored, actor_stats, critic_stats, sync, timer)
        if alg.name == "raro":
            metrics.update(rb.metrics)
        if t.dump_rollouts_every and step % t.dump_rollouts_every == 0:
            _dump_rollouts(run.root, step, scored)
            if alg.name == "raro":
                _dump_judgements(run.root, step, rb, len(batch))
        if val_prompts and (step == t.steps or (t.val_every and step % t.val_every == 0)):
            metrics.update(validate(actors, val_prompts, cfg, score_fn, tokenizer, run.root, step))
        tracker.log(step, metrics)
        stopping = stop is not None and stop.signal is not None  # read once: save and exit agree
        if checkpoint_due(cfg, step, time.monotonic() - last_save) or stopping:
            saving = time.monotonic()
            state = TrainerState(step=step, sampler=SamplerState(sampler.epoch, sampler.position))
            tmp = run.begin_checkpoint(step)
            for g in groups:
                g.call("save", str(tmp / g.name), {"step": step})
            if alg.name == "raro":
                atomic_write(tmp / _REPLAY_FILE, json.dumps(buffer.state_dict()))
            run.commit_checkpoint(tmp, state, t.keep_last)
            log.info("checkpoint of step %d saved in %.1f s", step, time.monotonic() - saving)
            last_save = time.monotonic()
        if stopping and step < t.steps:
            log.warning("%s: stopped after step %d with a checkpoint; run again to resume (exit code %d)",
                        signal.Signals(stop.signal).name, step, EXIT_STOPPED)
            tracker.close()
            raise SystemExit(EXIT_STOPPED)
    tracker.close()


def checkpoint_due(cfg: Config, step: int, since_save_s: float) -> bool:
    """Save after ``step``: the last step, every ``trainer.save_every`` steps, or when
    ``trainer.save_every_minutes`` have passed since the last checkpoint (``since_save_s`` seconds)."""
    t = cfg.trainer
    return (step == t.steps or (t.save_every > 0 and step % t.save_every == 0)
            or (t.save_every_minutes > 0 and since_save_s >= 60 * t.save_every_minutes))


class StopRequest:
    """Signal handler: records the first SIGUSR1/SIGTERM (``signal``); the loop then finishes the step in
    progress, saves a checkpoint and exits with ``EXIT_STOPPED``. A second SIGTERM kills as usual (a
    SIGUSR1 first, e.g. the Slurm job script's, then a pre-emption's SIGTERM: still the checkpoint)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, frame) -> None:
        # Nothing else here: a handler runs between two bytecodes of the main thread (no logging locks).
        self.signal = self.signal or signum
        if signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def stop_signals() -> Iterator[StopRequest]:
    """SIGUSR1 and SIGTERM set a ``StopRequest`` instead of ending the process, for the block."""
    stop = StopRequest()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _update(cfg: Config, step: int, actors: WorkerGroup, critic: WorkerGroup | None, exp: Experience,
            reward_B: torch.Tensor, group_B: torch.Tensor, is_critic_B: torch.Tensor | None, on_policy: bool,
            timer: dict[str, float]) -> tuple[Experience, list[dict], list[dict], list[dict]]:
    """Log-probs (old, reference, critic values) -> advantages -> ppo_epochs x mini_batches updates ->
    weight sync. Returns the completed experience and the actor's, critic's and sync's stats."""
    alg = cfg.algorithm
    # The rollout engines free the devices while Megatron computes; the sync at the end wakes them.
    actors.call("sleep_engine")
    with _timed(timer, "logprobs"):
        if not on_policy:
            old_logp_BT, _ = (torch.cat(x) for x in zip(*actors.replicas(actors.call("logprobs", exp)),
                                                        strict=True))
            exp = exp.with_fields(old_logp_BT=old_logp_BT)
        if alg.kl_coef > 0:
            exp = exp.with_fields(ref_logp_BT=torch.cat(actors.replicas(actors.call("ref_logprobs", exp))))
        if critic is not None:
            exp = exp.with_fields(values_BT=torch.cat(critic.replicas(critic.call("values", exp))))

    exp = exp.with_fields(**compute_advantages(cfg, exp, reward_B, group_B, is_critic_B))

    with _timed(timer, "train"):
        actor_stats, critic_stats = [], []
        for _ in range(alg.ppo_epochs):
            for m in range(alg.mini_batches):
                mini = exp.select(slice(len(exp) * m // alg.mini_batches, len(exp) * (m + 1) // alg.mini_batches))
                actor_stats.append(actors.call("train", mini, _lr(cfg.optim.lr, cfg, step))[0])
                if critic is not None:
                    critic_stats.append(critic.call("train", mini, _lr(cfg.optim.critic_lr, cfg, step))[0])
    with _timed(timer, "sync"):
        sync = [s for s in actors.call("sync_weights") if s is not None]

    return exp, actor_stats, critic_stats, sync


def compute_advantages(cfg: Config, exp: Experience, reward_B: torch.Tensor, group_B: torch.Tensor,
                       is_critic_B: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """GRPO: the group-relative outcome advantage on every response token. RARO: the same within the
    policy groups and within the critic groups, scaled so the loss is lambda_pol * J_pol +
    lambda_crit * J_crit. PPO: the outcome reward on the last response token (minus the per-token KL
    when kl_in_reward), GAE with the critic's values, whitened advantages; also the critic's targets
    (``returns_BT``)."""
    alg, mask_BT = cfg.algorithm, exp.mask_BT
    if alg.name in ("grpo", "raro"):
        adv_B = grpo_advantages(reward_B, group_B, mode=alg.grpo_mode)
        if alg.name == "raro":
            adv_B = adv_B * role_advantage_scale(is_critic_B, mask_BT, alg.loss_agg_mode,
                                                 lambda_pol=cfg.raro.lambda_pol, lambda_crit=cfg.raro.lambda_crit)
        return {"adv_BT": broadcast_to_tokens(adv_B, mask_BT)}
    last_B = exp.lengths_B - 1
    token_reward_BT = torch.zeros_like(mask_BT)
    token_reward_BT[torch.arange(len(exp)), last_B] = reward_B
    if alg.kl_in_reward and alg.kl_coef > 0:
        kl_BT = kl_penalty(exp.old_logp_BT, exp.ref_logp_BT, alg.kl_kind) * mask_BT
        token_reward_BT = kl_in_reward(token_reward_BT, kl_BT, mask_BT, alg.kl_coef)
    adv_BT, returns_BT = gae(token_reward_BT, exp.values_BT, mask_BT, gamma=alg.gamma, lam=alg.lam)
    if alg.whiten_advantages:
        adv_BT = whiten(adv_BT, mask_BT)
    return {"adv_BT": adv_BT, "returns_BT": returns_BT}


def step_metrics(cfg: Config, step: int, exp: Experience, scored: list[SampleResult], actor_stats: list[dict],
                 critic_stats: list[dict], sync: list[dict], timer: dict[str, float]) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in scored])
    lengths = torch.tensor([float(s.response_tokens) for s in scored])
    m = {"reward/mean": rewards.mean(), "reward/std": rewards.std() if len(rewards) > 1 else 0.0,
         "accuracy": sum(s.correct for s in scored) / len(scored),
         "response_length/mean": lengths.mean(), "response_length/max": lengths.max(),
         "response_length/clip_ratio": sum(s.truncated for s in scored) / len(scored),
         "reward/errors": sum(bool(s.score_error) and not s.timed_out for s in scored),
         "reward/timeouts": sum(s.timed_out for s in scored)}
    for source in sorted({s.data_source for s in scored}):
        mine = [s for s in scored if s.data_source == source]
        # by_source/...: no metric name may be a path prefix of another (MLflow's file store: one file each)
        m[f"by_source/{source}/reward"] = sum(s.reward for s in mine) / len(mine)
        m[f"by_source/{source}/accuracy"] = sum(s.correct for s in mine) / len(mine)
    if exp.old_logp_BT is not None:
        m.update({f"rollout/{k}": v for k, v in logprob_mismatch(exp.old_logp_BT, exp.rollout_logp_BT,
                                                                 exp.mask_BT).items()})
    elif actor_stats:  # measured in the (single) update's forward pass
        m["rollout/token_mult_prob_error"] = actor_stats[0]["mismatch_sum"] / max(actor_stats[0]["tokens"], 1)
        m["rollout/max_abs_logp_diff"] = actor_stats[0]["logp_diff_max"]
    if actor_stats:
        m.update(_train_metrics("actor", actor_stats, {"clipfrac": "clipfrac_sum", "ppo_kl": "ppo_kl_sum",
                                                       "entropy": "entropy_sum", "kl": "kl_sum"}, "pg_loss"))
    m["actor/lr"] = _lr(cfg.optim.lr, cfg, step)
    if critic_stats:
        m.update(_train_metrics("critic", critic_stats, {"vf_clipfrac": "vf_clipfrac_sum", "vpred": "vpred_sum"},
                                "vf_loss"))
        # of the values the advantages used (before this step's critic update), against their targets
        m["critic/explained_variance"] = explained_variance(exp.values_BT, exp.returns_BT, exp.mask_BT)
        ret = exp.returns_BT[exp.mask_BT.bool()]
        m["critic/returns_var"] = ret.var(unbiased=False) if ret.numel() else 0.0
    episodes = [s.env for s in scored if s.env]
    for key in ("turns", "searches", "tool_errors", "em", "f1", "retrieval_recall", "citation_precision"):
        if episodes and key in episodes[0]:
            m[f"env/{key}"] = sum(float(e[key]) for e in episodes) / len(episodes)
    if sync:
        m["sync/bytes"] = sum(s["bytes"] for s in sync)
        m["sync/seconds"] = max(s["seconds"] for s in sync)
    tokens = int(exp.lengths_B.sum())
    m.update({f"time/{k}": v for k, v in timer.items()})
    m["throughput/tokens_per_s"] = tokens / max(timer["step"], 1e-9)
    return {k: float(v) for k, v in m.items()}


def _train_metrics(prefix: str, stats: list[dict], token_sums: dict[str, str], loss: str) -> dict[str, float]:
    """Mean over the step's optimizer steps; token sums become per-token means."""
    out = {f"{prefix}/loss": sum(s["loss"] for s in stats) / len(stats),
           f"{prefix}/{loss}": sum(s[f"{loss}_num"] / max(s[f"{loss}_den"], 1) for s in stats) / len(stats),
           f"{prefix}/grad_norm": sum(s["grad_norm"] for s in stats) / len(stats)}
    for name, key in token_sums.items():
        if key in stats[0]:
            out[f"{prefix}/{name}"] = sum(s[key] / max(s["tokens"], 1) for s in stats) / len(stats)
    return out


def validate(actors: WorkerGroup, val_prompts: list[TokenizedPrompt], cfg: Config, score_fn: ScoreFn,
             tokenizer=None, root: Path | None = None, step: int = 0) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts, overall and per data_source (episodes under an env); the
    samples go to ``root/rollouts/val_step_N.jsonl`` when ``root`` is given."""
    greedy = Sampling(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens, stop=tuple(cfg.rollout.stop))
    completions = None
    if env_enabled(cfg):
        _, _, results = run_env(cfg, val_prompts, partial(_generate_ids, actors), tokenizer, greedy)
    else:
        completions = _generate(actors, val_prompts, greedy)
        results = score_fn(val_prompts, completions)
    if root is not None:
        dump_validation(root, step, val_prompts, results, completions)
    out = {"val/accuracy": sum(r.correct for r in results) / len(results),
           "val/reward": sum(r.reward for r in results) / len(results)}
    for s in summarize(results, 1, [1]):
        out[f"val/by_source/{s.data_source}/accuracy"] = s.accuracy
    return out


def _generate(actors: WorkerGroup, prompts: list[TokenizedPrompt], sampling: Sampling):
    """Split the prompts over the rollout engines (one per data-parallel replica, or the colocated SPMD
    engines of rollout.tensor_parallel_size ranks each); completions in prompt order."""
    leaders = actors.engine_leaders()
    n = len(leaders)
    bounds = [round(i * len(prompts) / n) for i in range(n + 1)]
    parts = [[p.token_ids for p in prompts[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    # Prompt i of the whole batch is sampled with seed + i, whichever replica serves it.
    samplings = [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + a) for a in bounds[:-1]]
    results = actors.call("generate", parts, samplings)
    return [c for i in leaders for c in results[i]]


def _generate_ids(actors: WorkerGroup, contexts: list[list[int]], sampling: Sampling):
    """``_generate`` for token-id contexts (the turns of multi-turn episodes)."""
    return _generate(actors, [TokenizedPrompt(record=None, text="", token_ids=c) for c in contexts], sampling)


def _dump_rollouts(root: Path, step: int, scored: list[SampleResult]) -> None:
    folder = root / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"step_{step:08d}.jsonl", "".join(json.dumps(asdict(s)) + "\n" for s in scored))


def dump_validation(root: Path, step: int, prompts: list[TokenizedPrompt], results: list[SampleResult],
                    completions=None) -> None:
    """One row per greedy sample: the scored result plus the prompt exactly as the model read it (and the
    response's token ids, single-turn)."""
    folder = root / "rollouts"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p.text, "prompt_token_ids": p.token_ids, **asdict(r)}
            for p, r in zip(prompts, results, strict=True)]
    for row, group in zip(rows, completions or [], strict=False):
        row["response_token_ids"] = list(group[0].token_ids)
    atomic_write(folder / f"val_step_{step:08d}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _dump_judgements(root: Path, step: int, rb, n_policy_prompts: int) -> None:
    """RARO: the critic's prompts and judgements of the step, one line per judgement."""
    rows, b = [], sum(len(g) for g in rb.groups[:n_policy_prompts])
    for prompt, group in zip(rb.prompts[n_policy_prompts:], rb.groups[n_policy_prompts:], strict=True):
        for c in group:
            rows.append({"index": prompt.record.extra_info["index"], "expert_shown_as": prompt.record.ground_truth,
                         "historical": prompt.record.extra_info["historical"], "critic_prompt": prompt.text,
                         "judgement": c.text, "critic_reward": float(rb.reward_B[b]), "kept": bool(rb.keep_B[b])})
            b += 1
    atomic_write(root / "rollouts" / f"step_{step:08d}_critic.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _sampling(cfg: Config, step: int) -> Sampling:
    r = cfg.rollout
    return Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, stop=tuple(r.stop),
                    seed=(cfg.trainer.seed * 100_000 + step) * 10_000)


def _lr(base: float, cfg: Config, step: int) -> float:
    warmup = cfg.optim.warmup_steps
    return base * min(1.0, step / warmup) if warmup else base


@contextmanager
def _timed(timer: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timer[name] = time.perf_counter() - start


def _load_prompts(cfg: Config) -> tuple[list[TokenizedPrompt], list[TokenizedPrompt], object]:
    from transformers import AutoTokenizer

    from megareason.models.build import HFCheckpoint
    from megareason.models.hub import resolve_model_path

    path = resolve_model_path(cfg.model.path)
    p = cfg.parallel
    HFCheckpoint(path).arch.check_parallelism(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer
                                                  else path))
    d = policy_data(cfg)
    prompts = tokenize_prompts(load_records(d), tokenizer, d.max_prompt_length, d.truncation)
    if len(prompts) < cfg.trainer.prompts_per_step:
        raise ConfigError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} but the training data has "
                         f"only {len(prompts)} prompts")
    val = []
    if d.val_sources:
        val = tokenize_prompts(load_records(replace(d, sources=d.val_sources)), tokenizer, d.max_prompt_length,
                               d.truncation)
    return prompts, val, tokenizer


def _check_cluster(cfg: Config) -> None:
    """Refuse a layout the Ray cluster cannot hold, before any worker starts."""
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
    cpus, gpus = cluster_size()
    if torch.cuda.is_available() or gpus:
        if world > gpus:
            raise ConfigError(f"parallel: TP x PP x DP = {world} ranks but the Ray cluster has {gpus} GPUs")
    elif world > cpus:
        raise ConfigError(f"parallel: TP x PP x DP = {world} ranks but the Ray cluster has {cpus} CPUs "
                         "(one rank per CPU at most)")


def _start_workers(cfg: Config) -> list[WorkerGroup]:
    import os

    roles = [(PolicyWorker, "actor")] + ([(CriticWorker, "critic")] if cfg.algorithm.name == "ppo" else [])
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
    # Colocated: the roles share each GPU; on CPU the ranks share the cores (the roles take turns).
    gpus = 1.0 / len(roles) if torch.cuda.is_available() else 0
    threads = max(1, (os.cpu_count() or 1) // world)
    return [WorkerGroup(cls, cfg, name, gpus, threads) for cls, name in roles]

