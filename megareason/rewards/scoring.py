"""Scoring a batch of completions with the configured reward, and the per-data_source summary.

Used by ``megareason eval``, the trainer (``train``, ``sft``) and the environments: ``scorer_from`` picks
the reward from the config (and checks the data has one at start-up), ``scoring_pool`` starts the
scoring processes, ``score`` turns (prompt, completions) into ``SampleResult`` rows and ``summarize``
reports them per data_source (accuracy, pass@k, response lengths, errors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from math import comb

from megareason.config.schema import RewardConfig, TinyVConfig
from megareason.data.records import DataError, PromptRecord, TokenizedPrompt
from megareason.rewards.custom import CustomRewards, CustomScorer, Scorer, load_rewards
from megareason.rewards.pool import ScoreOutcome, ScorePool, ScoreRequest, score_one
from megareason.rewards.registry import compute_score, get_reward_fn
from megareason.rewards.tinyv import apply_tinyv, is_tinyv, rubric_criteria
from megareason.rollout.records import Completion

log = logging.getLogger(__name__)


@dataclass
class SampleResult:
    index: int
    sample: int
    data_source: str
    question: str
    ground_truth: str
    response: str
    reward: float | None  # None: a training row with no reward (RARO: filtered or never judged; masked)
    correct: bool
    response_tokens: int
    truncated: bool
    score_error: str = ""
    timed_out: bool = False
    env: dict = field(default_factory=dict)  # a multi-turn episode's details (turns, retrieval, citations)


@dataclass
class SourceSummary:
    data_source: str
    prompts: int
    samples: int
    accuracy: float
    mean_reward: float
    pass_at: dict[int, float]
    mean_response_tokens: float
    max_response_tokens: int
    clip_ratio: float  # fraction of responses cut at rollout.max_tokens
    score_errors: int
    # eval.rerank=critic: accuracy of the answer the critic tournament picked from each prompt's n.
    rerank_accuracy: float | None = None


def scorer_from(reward: RewardConfig, records: Iterable[PromptRecord] = ()) -> Scorer:
    """The configured custom rewards (``reward.custom``, ``reward.by_source``) routed beside the built-in
    ones, else the built-in rewards alone (by data_source). Every data_source of ``records`` must have
    a reward, and under ``reward.tinyv.verifier=rrm`` every ``_tinyv`` row its rubric
    (``extra_info.criteria``): checked here, at start-up, not mid-run."""
    records = list(records)
    if reward.tinyv.verifier == "rrm":
        for rec in records:
            if is_tinyv(rec.data_source):
                try:
                    rubric_criteria(rec.extra_info, f"data row {rec.extra_info.get('index', '?')} (data_source "
                                                    f"{rec.data_source!r})")
                except ValueError as e:
                    raise DataError(f"{e} (set it in the row, or data.sources[].extra_info.criteria for the "
                                    "whole source)") from None
    r = reward
    custom = load_rewards(r.custom, r.by_source, r.trl_format) if r.custom or r.by_source else None
    for source in sorted({rec.data_source for rec in records}):
        if custom is not None and custom.route(source) is not None:
            continue
        try:
            get_reward_fn(source)
        except ValueError as e:
            raise DataError(f"no reward for the data: {e}") from None
    return custom if custom is not None else compute_score


def scoring_pool(reward: RewardConfig, scorer: Scorer) -> contextlib.AbstractContextManager[ScorePool | None]:
    """``reward.workers`` scoring processes with ``reward.timeout`` per sample; 0 workers: none."""
    if reward.workers == 0:
        return contextlib.nullcontext()
    return ScorePool(scorer, workers=reward.workers, timeout=reward.timeout)


def score(prompts: list[TokenizedPrompt], groups: list[list[Completion]], scorer: Scorer = compute_score,
          pool: ScorePool | None = None, tinyv: TinyVConfig | None = None) -> list[SampleResult]:
    """Score every completion with the reward of its prompt's data_source (or ``scorer``), in ``pool``
    (worker processes, a per-sample timeout) when given, else in this process; the samples routed to a
    TRL batch function (``rewards.custom``) by one call of it, in this process. Then the samples whose
    data_source ends in ``_tinyv`` go, in one batch, through the TinyV verifier configured by ``tinyv``
    (None: the ``TinyVConfig`` defaults); see ``megareason.rewards.tinyv``.

    A scorer that raises or times out gives reward 0 and is counted (``score_error``, ``timed_out``),
    never silently; the pool logs the first few with their sample ids. So is a TinyV sample the
    verifier gave no verdict (``score_error`` "TinyVFallback: ...", "TinyVFallback (timeout): ...").
    """
    pairs = [(p, j, c) for p, group in zip(prompts, groups, strict=True) for j, c in enumerate(group)]
    requests = [ScoreRequest(p.record.data_source, c.text, p.record.ground_truth, p.record.extra_info,
                             sample_id=f"{p.record.extra_info.get('index', '?')}/{j}", prompt=p.record.prompt)
                for p, j, c in pairs]
    outcomes = _score_requests(requests, scorer, pool)
    outcomes = _verify_tinyv(requests, outcomes, [p.record.prompt[-1]["content"] for p, _, _ in pairs],
                             tinyv if tinyv is not None else TinyVConfig())
    return [SampleResult(
        index=p.record.extra_info.get("index", -1), sample=j, data_source=p.record.data_source,
        question=p.record.prompt[-1]["content"], ground_truth=p.record.ground_truth, response=c.text,
        reward=o.score, correct=o.correct, response_tokens=len(c.token_ids), truncated=c.truncated,
        score_error=o.error, timed_out=o.timed_out,
    ) for (p, j, c), o in zip(pairs, outcomes, strict=True)]


def _score_requests(requests: list[ScoreRequest], scorer: Scorer, pool: ScorePool | None) -> list[ScoreOutcome]:
    """One outcome per request, in order. Samples routed to a TRL batch function are scored by one call
    of it per function, in this process (``_score_batch``); the others one by one in ``pool`` (or here)."""
    batches: dict[int, tuple[CustomScorer, list[int]]] = {}
    for i, r in enumerate(requests):
        target = _route(scorer, r.data_source)
        if target is not None and target.batch:
            batches.setdefault(id(target), (target, []))[1].append(i)
    batched = {i for _, idx in batches.values() for i in idx}
    rest = [r for i, r in enumerate(requests) if i not in batched]
    rest_out = iter(pool.score(rest) if pool is not None and rest else [score_one(scorer, r) for r in rest])
    out: list[ScoreOutcome | None] = [None if i in batched else next(rest_out) for i in range(len(requests))]
    for target, idx in batches.values():
        for i, o in zip(idx, _score_batch(target, [requests[i] for i in idx]), strict=True):
            out[i] = o
    return out


def _route(scorer: Scorer, data_source: str) -> CustomScorer | None:
    if isinstance(scorer, CustomRewards):
        return scorer.route(data_source)
    return scorer if isinstance(scorer, CustomScorer) else None


def _score_batch(scorer: CustomScorer, requests: list[ScoreRequest]) -> list[ScoreOutcome]:
    """A TRL batch function on ``requests`` in one call. Its exception is every sample's error; a None
    for a sample is that sample's error. Either way counted (``score_error``), never a silent 0."""
    rows = [(r.data_source, r.response, r.ground_truth, r.extra_info, r.prompt) for r in requests]
    try:
        scores = scorer.score_batch(rows)
    except Exception as e:  # a broken reward must not lose the step; the error is counted instead
        log.warning("reward %s failed on a batch of %d samples: %s: %s", scorer, len(rows), type(e).__name__, e)
        return [ScoreOutcome(score=0.0, correct=False, error=f"{type(e).__name__}: {e}") for _ in rows]
    where = f"{scorer.path}:{scorer.name}"
    return [ScoreOutcome(score=0.0, correct=False, error=f"ValueError: {where} returned None for the sample")
            if v is None else ScoreOutcome(score=v, correct=v >= 1.0) for v in scores]


def _verify_tinyv(requests: list[ScoreRequest], outcomes: list[ScoreOutcome], questions: list[str],
                  cfg: TinyVConfig) -> list[ScoreOutcome]:
    """``outcomes`` with those of the ``_tinyv`` requests rescored by ``apply_tinyv`` in one batch. The
    verifier sees ``extra_info["question"]``, else the prompt's last message."""
    idx = [i for i, r in enumerate(requests) if is_tinyv(r.data_source)]
    if not idx:
        return outcomes
    batch = [dataclasses.replace(requests[i], extra_info={"question": questions[i], **requests[i].extra_info})
             for i in idx]
    rescored, stats = apply_tinyv(batch, [outcomes[i] for i in idx], cfg)
    log.info("TinyV (%s, %s): %d samples, %d asked, %d upgraded, %d fallbacks (%d timeouts)", cfg.verifier,
             cfg.mode, len(idx), stats["asked"], stats["upgraded"], stats["fallbacks"], stats["timeouts"])
    out = list(outcomes)
    for i, o in zip(idx, rescored, strict=True):
        out[i] = o
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021).

    The probability that at least one of ``k`` samples drawn without replacement is correct:
    ``1 - C(n - c, k) / C(n, k)``. Requires ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(samples: Iterable[SampleResult], n: int, pass_k: list[int],
              picks: list[int] | None = None) -> list[SourceSummary]:
    """Per data_source. ``picks`` (one per prompt, in prompt order) selects each prompt's reranked sample."""
    samples = list(samples)
    picked = set()
    if picks is not None:
        starts = [i for i, s in enumerate(samples) if s.sample == 0]  # samples are in (prompt, sample) order
        picked = {start + pick for start, pick in zip(starts, picks, strict=True)}
    by_source: dict[str, list[SampleResult]] = defaultdict(list)
    for s in samples:
        by_source[s.data_source].append(s)
    ks = sorted(k for k in set(pass_k) if k <= n)
    out = []
    for source in sorted(by_source):
        rows = by_source[source]
        by_prompt: dict[int, list[SampleResult]] = defaultdict(list)
        for s in rows:
            by_prompt[s.index].append(s)
        out.append(SourceSummary(
            data_source=source,
            prompts=len(by_prompt),
            samples=len(rows),
            accuracy=sum(s.correct for s in rows) / len(rows),
            mean_reward=sum(s.reward for s in rows) / len(rows),
            pass_at={k: sum(pass_at_k(len(g), sum(s.correct for s in g), k) for g in by_prompt.values())
                     / len(by_prompt) for k in ks},
            mean_response_tokens=sum(s.response_tokens for s in rows) / len(rows),
            max_response_tokens=max(s.response_tokens for s in rows),
            clip_ratio=sum(s.truncated for s in rows) / len(rows),
            score_errors=sum(bool(s.score_error) for s in rows),
            rerank_accuracy=(sum(samples[i].correct for i in picked if samples[i].data_source == source)
                             / len(by_prompt)) if picks is not None else None,
        ))
    return out
