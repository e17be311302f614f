"""RARO's critic pass: from one step's policy rollouts to the rows of the joint update.

``critic_round`` takes the step's policy prompts and completions and

1. drops policy responses over ``raro.max_response_length`` tokens (or cut by ``rollout.max_tokens``),
   or with ``raro.truncated`` judges them like the others (``judge``) or pays them as losses without a
   judgement (``lose``);
2. builds a triplet (question, expert answer, policy answer) for every other response, and mixes in
   historical triplets from the replay buffer so that they make ``raro.replay_buffer_ratio`` of the
   critic's batch; with ``raro.replay_order=store_first`` (the order of RARO's verl implementation) the
   fresh triplets enter the buffer first, so the historical ones may include them;
3. shows the critic each triplet's two answers in random order (``raro.shuffle_answers``), samples
   ``raro.critic_n`` judgements per triplet, parses the labels and maps them back to roles;
4. pays both roles from the reward matrix (``algorithms.raro``): a policy response gets the mean policy
   reward of the parseable judgements of its triplet; unparseable judgements, and policy responses
   without any parseable judgement, are masked out (``keep_B`` False) and counted;
5. with ``replay_order=sample_first``, adds the fresh triplets to the buffer only now (historical then
   means earlier steps).

During ``raro.critic_warmup_steps`` the policy rows are masked out of the update (the critic learns alone).
With ``raro.critic=answer_equality`` no critic is sampled: each fresh triplet's verdict is a Tie when the
policy row is correct (``correct``, the data source's registered reward) and the expert otherwise, and
the update has policy rows only.

The result lists prompts and completions in the order of the update's rows: the policy groups first
(one group per question), then one group of ``critic_n`` judgements per triplet.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from megareason.algorithms.raro import Verdict, parse_label, reward_matrix, to_role
from megareason.config.schema import RaroConfig
from megareason.data.prompts import demonstration
from megareason.data.records import PromptRecord, TokenizedPrompt
from megareason.raro.prompts import CRITIC_SYSTEM_PROMPT, critic_messages, policy_answer, render
from megareason.raro.replay import ReplayBuffer, Triplet
from megareason.rollout.records import Completion, Sampling

# (prompts, sampling) -> completions per prompt, in prompt order
GenerateFn = Callable[[list[TokenizedPrompt], Sampling], list[list[Completion]]]


@dataclass
class RaroBatch:
    """One step's rows for the joint update: policy rows, then critic rows (``is_critic_B``)."""

    prompts: list[TokenizedPrompt]
    groups: list[list[Completion]]
    reward_B: torch.Tensor  # float32 [B]
    group_B: torch.Tensor  # int64 [B]: GRPO groups (a question's rollouts; a triplet's judgements)
    keep_B: torch.Tensor  # bool [B]: False for masked rows (no gradient)
    paid_B: torch.Tensor  # bool [B]: rows with a reward (keep_B, and the policy rows a critic warm-up masks)
    is_critic_B: torch.Tensor  # bool [B]
    metrics: dict[str, float]


def expert_answer(record: PromptRecord, template: str = "") -> str:
    """The expert's answer as the critic sees it. No ``template`` (``raro.expert_template``): the final
    answer, ``extra_info["expert_answer"]`` when the loader set one (e.g. the countdown expression, whose
    ground truth is the target number), else the ground truth. A template: the demonstration it makes
    of the row, cut as a policy response is (``policy_answer``)."""
    if not template:
        return str(record.extra_info.get("expert_answer", record.ground_truth))
    where = f"raro expert answer of row {record.extra_info.get('index', '?')}"
    return policy_answer(demonstration(record, template, where, "raro.expert_template")[1])


def verdict_regex(reasoning_chars: int) -> str | None:
    """The critic's reply as a regular expression: up to ``reasoning_chars`` characters, then the
    verdict line ``parse_label`` reads. None (unconstrained) for 0."""
    return rf"[\s\S]{{0,{reasoning_chars}}}\nVerdict: (A|B|Tie)" if reasoning_chars else None


def critic_round(cfg: RaroConfig, step: int, seed: int, prompts: list[TokenizedPrompt],
                 completions: list[list[Completion]], buffer: ReplayBuffer, tokenizer, generate: GenerateFn,
                 sampling: Sampling, max_prompt_tokens: int, correct: list[bool] | None = None) -> RaroBatch:
    """See the module docstring. ``sampling`` is the policy's (its seed is offset for the critic);
    critic prompts longer than ``max_prompt_tokens`` are dropped (their policy rows masked). ``correct``:
    each policy row's correctness, in (prompt, sample) order (``raro.critic=answer_equality`` only)."""
    rng = random.Random(f"raro:{seed}:{step}")
    # 1-2: fresh triplets (with the policy row each came from), then historical ones.
    rows = [(i, c) for i, group in enumerate(completions) for c in group]
    cut = [c.truncated or bool(cfg.max_response_length and len(c.token_ids) > cfg.max_response_length)
           for _, c in rows]
    policy_reward = [0.0] * len(rows)
    policy_keep = [False] * len(rows)
    if cfg.truncated == "lose":  # paid as the expert's win, without a judgement
        loss = reward_matrix(Verdict.EXPERT, tau_pol=cfg.tau_pol, tau_crit=cfg.tau_crit)[0]
        for b in range(len(rows)):
            if cut[b]:
                policy_reward[b], policy_keep[b] = loss, True
    fresh: list[tuple[int, Triplet]] = []
    for b, (i, c) in enumerate(rows):
        if cut[b] and cfg.truncated != "judge":
            continue
        rec = prompts[i].record
        fresh.append((b, Triplet(question=str(rec.extra_info.get("question", rec.prompt[-1]["content"])),
                                 expert=expert_answer(rec, cfg.expert_template), policy=policy_answer(c.text),
                                 data_source=rec.data_source, index=int(rec.extra_info.get("index", -1)),
                                 step=step)))
    if cfg.critic == "answer_equality":
        return _answer_equality(cfg, step, prompts, completions, rows, fresh, policy_reward, policy_keep, correct,
                                buffer)
    ratio = cfg.replay_buffer_ratio
    want = round(len(fresh) * ratio / (1 - ratio))
    store_first = cfg.replay_order == "store_first"
    if store_first:
        buffer.add([t for _, t in fresh])
    historical = buffer.sample(want, seed=rng.randrange(2**31))
    judged = fresh + [(None, t) for t in historical]

    # 3: the critic's prompts, answers in random order.
    critic_prompts, kept = [], []
    system = cfg.critic_system_prompt or CRITIC_SYSTEM_PROMPT
    for k, (b, t) in enumerate(judged):
        expert_first = rng.random() < 0.5 if cfg.shuffle_answers else True
        a, bb = (t.expert, t.policy) if expert_first else (t.policy, t.expert)
        rec = PromptRecord(prompt=critic_messages(system, t.question, a, bb), data_source="raro_critic",
                           ground_truth="A" if expert_first else "B",
                           extra_info={"index": t.index, "expert_first": expert_first, "historical": b is None})
        text, ids = render(tokenizer, rec.prompt)
        if len(ids) <= max_prompt_tokens:
            critic_prompts.append(TokenizedPrompt(record=rec, text=text, token_ids=ids))
            kept.append(k)
    # The policy's stop strings (rollout.stop) are its own: the critic stops at EOS or its verdict.
    critic_sampling = replace(sampling, n=cfg.critic_n, max_tokens=cfg.critic_max_tokens, stop=(),
                              seed=None if sampling.seed is None else sampling.seed + len(prompts),
                              regex=verdict_regex(cfg.constrain_verdict_chars))
    judgements = generate(critic_prompts, critic_sampling) if critic_prompts else []

    # 4: rewards from the matrix; the policy's averaged over its triplet's parseable judgements.
    critic_reward, critic_keep, verdicts = [], [], []
    for k, tp, group in zip(kept, critic_prompts, judgements, strict=True):
        b = judged[k][0]
        pays = []
        for c in group:
            v = to_role(parse_label(c.text), tp.record.extra_info["expert_first"])
            pay = reward_matrix(v, tau_pol=cfg.tau_pol, tau_crit=cfg.tau_crit)
            verdicts.append((v, b is not None))
            critic_reward.append(pay[1] if pay else 0.0)
            critic_keep.append(pay is not None)
            if pay is not None:
                pays.append(pay[0])
        if b is not None and pays:
            policy_reward[b], policy_keep[b] = sum(pays) / len(pays), True

    # 5: the buffer learns this step's triplets (unless it did before the sampling).
    if not store_first:
        buffer.add([t for _, t in fresh])

    policy_paid = policy_keep  # the warm-up masks them from the update, not from the step's metrics
    if step <= cfg.critic_warmup_steps:
        policy_keep = [False] * len(rows)
    n_policy_groups = len(prompts)
    group_B = [i for i, _ in rows] + [n_policy_groups + g for g, grp in enumerate(judgements) for _ in grp]
    return RaroBatch(
        prompts=list(prompts) + critic_prompts,
        groups=list(completions) + judgements,
        reward_B=torch.tensor(policy_reward + critic_reward, dtype=torch.float32),
        group_B=torch.tensor(group_B, dtype=torch.long),
        keep_B=torch.tensor(policy_keep + critic_keep, dtype=torch.bool),
        paid_B=torch.tensor(policy_paid + critic_keep, dtype=torch.bool),
        is_critic_B=torch.tensor([False] * len(rows) + [True] * len(critic_reward), dtype=torch.bool),
        metrics=_metrics(verdicts, len(rows), len(fresh), len(historical), len(judged) - len(kept),
                         sum(policy_paid), buffer),
    )


def _answer_equality(cfg: RaroConfig, step: int, prompts: list[TokenizedPrompt], completions: list[list[Completion]],
                     rows: list, fresh: list[tuple[int, Triplet]], policy_reward: list[float], policy_keep: list[bool],
                     correct: list[bool] | None, buffer: ReplayBuffer) -> RaroBatch:
    """``raro.critic=answer_equality``: a perfect judge in place of the critic model (module docstring)."""
    if correct is None or len(correct) != len(rows):
        raise ValueError(f"raro.critic=answer_equality needs the correctness of each of the {len(rows)} policy rows "
                         f"(the data source's registered reward), got {None if correct is None else len(correct)}")
    verdicts = []
    for b, _ in fresh:
        v = Verdict.TIE if correct[b] else Verdict.EXPERT
        policy_reward[b], policy_keep[b] = reward_matrix(v, tau_pol=cfg.tau_pol, tau_crit=cfg.tau_crit)[0], True
        verdicts.append((v, True))
    return RaroBatch(
        prompts=list(prompts), groups=list(completions),
        reward_B=torch.tensor(policy_reward, dtype=torch.float32),
        group_B=torch.tensor([i for i, _ in rows], dtype=torch.long),
        keep_B=torch.tensor(policy_keep, dtype=torch.bool),
        paid_B=torch.tensor(policy_keep, dtype=torch.bool),
        is_critic_B=torch.zeros(len(rows), dtype=torch.bool),
        metrics=_metrics(verdicts, len(rows), len(fresh), 0, 0, sum(policy_keep), buffer),
    )


def _metrics(verdicts: list[tuple[Verdict | None, bool]], n_policy: int, n_fresh: int, n_historical: int,
             n_too_long: int, n_policy_kept: int, buffer: ReplayBuffer) -> dict[str, float]:
    """Critic accuracy: judgements naming the expert, among parseable non-tie ones (fresh and
    historical). Fool / expert-win / tie rates: among parseable judgements of fresh triplets."""
    def frac(num: int, den: int) -> float:
        return num / den if den else 0.0

    parsed = [(v, fresh) for v, fresh in verdicts if v is not None]
    decided = [v for v, _ in parsed if v is not Verdict.TIE]
    on_fresh = [v for v, fresh in parsed if fresh]
    return {
        "raro/critic_accuracy": frac(sum(v is Verdict.EXPERT for v in decided), len(decided)),
        "raro/tie_rate": frac(sum(v is Verdict.TIE for v, _ in parsed), len(parsed)),
        "raro/format_error_rate": frac(len(verdicts) - len(parsed), len(verdicts)),
        "raro/policy_fool_rate": frac(sum(v is Verdict.POLICY for v in on_fresh), len(on_fresh)),
        "raro/expert_win_rate": frac(sum(v is Verdict.EXPERT for v in on_fresh), len(on_fresh)),
        "raro/policy_filtered_rate": frac(n_policy - n_fresh, n_policy),
        "raro/policy_masked_rate": frac(n_policy - n_policy_kept, n_policy),
        "raro/critic_prompts_too_long": float(n_too_long),
        "raro/critic_fresh": float(n_fresh),
        "raro/critic_historical": float(n_historical),
        "raro/historical_fraction": frac(n_historical, n_fresh + n_historical),
        "raro/buffer_size": float(len(buffer)),
    }
