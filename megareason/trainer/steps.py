"""The rollout half of an RL step, one class per algorithm variant, chosen once per run (``rollout_step``).

Each turns the step's prompts into ``StepRows``: the experience the update learns from, each row's
reward and advantage group, and what the step logs. The variants:

* ``SingleTurn``: ``rollout.n`` completions per prompt from the vLLM engines, scored by the reward
  registry (GRPO, PPO);
* ``Episodes``: multi-turn environment episodes (``env.name``), scored by their environments;
* ``RaroRound``: either of those for the policy, then RARO's critic round (``raro.critic``): the critic's
  verdicts pay both roles, the registered reward only monitors accuracy. Its replay buffer is the
  run's algorithm state (``state``, saved in ``trainer_state.json``).

``trainer.offpolicy.OneStepOff`` wraps ``SingleTurn`` for one step off-policy rollouts. What the loop asks
of every variant is ``RolloutVariant``'s: the step's rows, whether the variant pushes the weights itself,
what to do before validation, and what a checkpoint keeps of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from megareason.algorithms.dapo import dynamic_sampling, mask_truncated, overlong_penalty
from megareason.config import Config
from megareason.data.records import TokenizedPrompt
from megareason.raro.critic import critic_round
from megareason.raro.replay import ReplayBuffer
from megareason.rewards.scoring import SampleResult
from megareason.rollout.records import Completion, Sampling, WeightUpdate
from megareason.settings import sampling_from
from megareason.trainer.driver import timed
from megareason.trainer.episodes import env_enabled, run_env
from megareason.trainer.experience import Experience, build_experience
from megareason.trainer.handles import PolicyHandle

# (prompts, completions per prompt) -> scored samples, in (prompt, sample) order
ScoreFn = Callable[[list[TokenizedPrompt], list[list[Completion]]], list[SampleResult]]
_REPLAY = "raro_replay"  # RARO's replay buffer in TrainerState.extra
log = logging.getLogger(__name__)


@dataclass
class StepRows:
    """One step's rows for the update (in ``exp`` order) and its scored policy samples."""

    exp: Experience
    reward_B: torch.Tensor  # float32 [B]
    group_B: torch.Tensor  # int64 [B]: the advantage groups (a prompt's samples; a triplet's judgements)
    is_critic_B: torch.Tensor | None  # bool [B]: RARO's critic rows; None without a critic role
    scored: list[SampleResult]  # the policy's samples, scored (RARO: rewarded by the critic), for metrics
    metrics: dict[str, float] = field(default_factory=dict)  # the variant's own (RARO's raro/*)
    judgements: list[dict] = field(default_factory=list)  # RARO: rows of rollouts/step_N_critic.jsonl
    sync: list[WeightUpdate] = field(default_factory=list)  # one step off-policy: the step's weight push


def sampling(cfg: Config, step: int, first_prompt: int = 0) -> Sampling:
    """The rollouts' sampling at ``step``: seeded by (trainer.seed, step), so a resumed run samples alike;
    prompt i of a batch gets seed + first_prompt + i (``first_prompt``: prompts drawn before in the step)."""
    return replace(sampling_from(cfg), seed=(cfg.trainer.seed * 100_000 + step) * 10_000 + first_prompt)


class RolloutVariant:
    """What the training loop asks of a rollout variant, with the synchronous variants' answers."""

    # Whether the variant pushes the weights into the engines itself (one step off: before launching the
    # next batch); else the loop syncs them after each update.
    pushes_weights = False

    def __call__(self, step: int, batch: list[TokenizedPrompt], timer: dict[str, float]) -> StepRows:
        raise NotImplementedError

    def state(self) -> dict:
        """The variant's state for the checkpoint (``TrainerState.extra``): none."""
        return {}

    def before_validation(self, step: int) -> None:
        """Make the engines ready to validate step ``step``'s weights: they are (the update's sync)."""

    def save_files(self, folder) -> None:
        """Write what a checkpoint keeps of the variant beside ``state``: nothing."""


class SingleTurn(RolloutVariant):
    """``rollout.n`` completions per prompt, scored by ``score_fn``; rows in (prompt, sample) order. DAPO's
    options apply here (``algorithm.dynamic_sampling``: ``more()`` gives the next prompts to draw;
    ``overlong_buffer``; ``mask_truncated``)."""

    def __init__(self, cfg: Config, actors: PolicyHandle, score_fn: ScoreFn, tokenizer,
                 more: Callable[[], list[TokenizedPrompt]] | None = None):
        self.cfg, self.actors, self.score_fn, self.tokenizer, self.more = cfg, actors, score_fn, tokenizer, more

    def samples(self, step: int, batch: list[TokenizedPrompt], timer: dict[str, float], first_prompt: int = 0
                ) -> tuple[list[TokenizedPrompt], list[list[Completion]], list[SampleResult]]:
        """(prompts, completions per prompt, scored samples in (prompt, sample) order)."""
        with timed(timer, "generate"):
            completions = self.actors.generate(batch, sampling(self.cfg, step, first_prompt))
        with timed(timer, "reward"):
            scored = self.score_fn(batch, completions)
        return batch, completions, scored

    def __call__(self, step: int, batch: list[TokenizedPrompt], timer: dict[str, float]) -> StepRows:
        alg = self.cfg.algorithm
        if not alg.dynamic_sampling:
            return self._rows(*self.samples(step, batch, timer))
        prompts, completions, scored = [], [], []

        def draw():
            b, c, s = self.samples(step, self.more() if prompts else batch, timer, first_prompt=len(prompts))
            prompts.extend(b)
            completions.extend(c)
            scored.extend(s)
            rows = self._rows(b, c, s)
            return None, rows.reward_B, rows.group_B

        drawn = dynamic_sampling(draw, want=len(batch), max_tries=alg.dynamic_sampling_max_tries)
        if not drawn.enough:
            log.warning("step %d: dynamic sampling found %d of %d informative groups in %d batches; training on "
                        "those", step, drawn.groups, len(batch), drawn.tries)
        rows = self._rows(prompts, completions, scored)
        keep = torch.cat([keep_B for _, keep_B in drawn.batches]).nonzero().flatten().tolist()
        return replace(rows, exp=rows.exp.select(keep), reward_B=rows.reward_B[keep], group_B=rows.group_B[keep],
                       metrics={**rows.metrics, "dapo/tries": drawn.tries, "dapo/informative_groups": drawn.groups,
                                "dapo/drawn_groups": drawn.drawn_groups})

    def _rows(self, prompts, completions, scored) -> StepRows:
        """The rows of (prompt, sample)-ordered samples, with DAPO's overlong shaping and truncation mask."""
        alg = self.cfg.algorithm
        exp = build_experience(prompts, completions)
        reward_B, metrics = torch.tensor([s.reward for s in scored]), {}
        if alg.overlong_buffer:
            penalty_B = overlong_penalty(torch.tensor([s.response_tokens for s in scored]),
                                         max_tokens=self.cfg.rollout.max_tokens, buffer=alg.overlong_buffer,
                                         penalty_factor=alg.overlong_penalty)
            reward_B, metrics = reward_B + penalty_B, {"dapo/overlong_penalty": penalty_B.mean().item()}
        if alg.mask_truncated:
            exp = exp.with_fields(mask_BT=mask_truncated(exp.mask_BT, torch.tensor([s.truncated for s in scored])))
        return StepRows(exp=exp, reward_B=reward_B, group_B=torch.arange(len(exp)) // self.cfg.rollout.n,
                        is_critic_B=None, scored=scored, metrics=metrics)


class Episodes(SingleTurn):
    """Multi-turn environment episodes, scored by their environments (timed as ``generate``)."""

    def samples(self, step, batch, timer, first_prompt=0):
        with timed(timer, "generate"):
            return run_env(self.cfg, batch, self.actors.generate_ids, self.tokenizer,
                           sampling(self.cfg, step, first_prompt))


class RaroRound(RolloutVariant):
    """The policy's samples (``policy``), then the critic's round: the joint update's rows are the policy
    rows, then the critic's; masked rows (filtered, unjudged, unparseable) leave the batch."""

    def __init__(self, cfg: Config, policy: SingleTurn, state: dict):
        self.cfg, self.policy = cfg, policy
        r = cfg.raro
        self.buffer = (ReplayBuffer.from_state(state[_REPLAY]) if _REPLAY in state
                       else ReplayBuffer(r.replay_buffer_size, r.replay_buffer_kind, cfg.trainer.seed))

    def state(self) -> dict:
        """The replay buffer (its triplets, counters and generator state), restored by ``__init__``."""
        return {_REPLAY: self.buffer.state_dict()}

    def __call__(self, step: int, batch: list[TokenizedPrompt], timer: dict[str, float]) -> StepRows:
        cfg, actors = self.cfg, self.policy.actors
        batch, completions, scored = self.policy.samples(step, batch, timer)
        with timed(timer, "critic"):
            rb = critic_round(cfg.raro, step, cfg.trainer.seed, batch, completions, self.buffer,
                              self.policy.tokenizer, actors.generate, sampling(cfg, step),
                              cfg.rollout.max_model_len - cfg.raro.critic_max_tokens, [s.correct for s in scored])
        # The policy rows come first, in scored's order; masked ones (filtered, never judged) have no reward.
        policy = ~rb.is_critic_B
        scored = [replace(s, reward=float(r) if k else None)
                  for s, r, k in zip(scored, rb.reward_B[policy], rb.paid_B[policy], strict=True)]
        keep = rb.keep_B.nonzero().flatten().tolist()
        return StepRows(exp=build_experience(rb.prompts, rb.groups).select(keep), reward_B=rb.reward_B[keep],
                        group_B=rb.group_B[keep], is_critic_B=rb.is_critic_B[keep], scored=scored,
                        metrics=rb.metrics | {"reward/masked_rate": rb.metrics["raro/policy_masked_rate"]},
                        judgements=_judgements(rb, len(batch)))


def rollout_step(cfg: Config, actors: PolicyHandle, score_fn: ScoreFn, tokenizer, state: dict,
                 more: Callable[[], list[TokenizedPrompt]] | None = None) -> RolloutVariant:
    """The run's variant: ``Episodes`` under an environment, else ``SingleTurn``; RARO wraps either.
    ``state``: the algorithm state of the checkpoint resumed from (``TrainerState.extra``); ``more()``: the
    next trainer.prompts_per_step prompts (DAPO's dynamic sampling draws them)."""
    policy = (Episodes if env_enabled(cfg) else SingleTurn)(cfg, actors, score_fn, tokenizer, more)
    return RaroRound(cfg, policy, state) if cfg.algorithm.name == "raro" else policy


def _judgements(rb, n_policy_prompts: int) -> list[dict]:
    """RARO: the critic's prompts and judgements of the step, one row per judgement."""
    rows, b = [], sum(len(g) for g in rb.groups[:n_policy_prompts])
    for prompt, group in zip(rb.prompts[n_policy_prompts:], rb.groups[n_policy_prompts:], strict=True):
        for c in group:
            rows.append({"index": prompt.record.extra_info["index"], "expert_shown_as": prompt.record.ground_truth,
                         "historical": prompt.record.extra_info["historical"], "critic_prompt": prompt.text,
                         "judgement": c.text, "critic_reward": float(rb.reward_B[b]), "kept": bool(rb.keep_B[b])})
            b += 1
    return rows
