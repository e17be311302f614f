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
from megareason.rewards.custom import Custom, CustomRewards, CustomScorer, Scorer, WeightedRewards, load_rewards
from megareason.rewards.pool import ScoreOutcome, ScorePool, ScoreRequest, score_one
from megareason.rewards.registry import base_source, compute_score, get_reward_fn, resolve_source
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
    parts: dict = field(default_factory=dict)  # reward.funcs: each function's own score, by its name


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


class RewardError(ValueError):
    """A reward failed on too many of a step's samples (``reward.max_error_rate``): the run stops."""


def reward_scorer(reward: RewardConfig) -> Scorer:
    """The configured custom rewards (``reward.custom`` or ``reward.funcs``, ``reward.by_source``) routed
    beside the built-in ones, else the built-in rewards alone (by data_source). The files are imported
    now: a missing file or a wrong signature is a one-line ``ConfigError``."""
    r = reward
    if r.custom or r.funcs or r.weights or r.by_source:
        return load_rewards(r.custom, r.by_source, r.trl_format, r.funcs, r.weights)
    return compute_score


def check_rewards(reward: RewardConfig, scorer: Scorer, records: Iterable[PromptRecord]) -> None:
    """At start-up, not mid-run: every data_source of ``records`` has a reward, every ``reward.by_source``
    key names one of them, and under ``reward.tinyv.verifier=rrm`` every ``_tinyv`` row has its rubric
    (``extra_info.criteria``)."""
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
    sources = sorted({rec.data_source for rec in records})
    names = set(sources) | {base_source(s) for s in sources}
    unmatched = sorted(k for k in reward.by_source if k not in names)
    if records and unmatched:
        raise DataError(f"reward.by_source names {', '.join(map(repr, unmatched))}, which no row has as its "
                        f"data_source; the data's sources: {', '.join(sources)}")
    for source in sources:
        if _route(scorer, source) is not None:
            continue
        try:
            get_reward_fn(source)
        except ValueError as e:
            raise DataError(f"no reward for the data: {e}") from None


def scorer_from(reward: RewardConfig, records: Iterable[PromptRecord] = ()) -> Scorer:
    """``reward_scorer``, its data checked by ``check_rewards``."""
    records = list(records)
    scorer = reward_scorer(reward)
    check_rewards(reward, scorer, records)
    return scorer


def describe_reward(scorer: Scorer, data_source: str, chat: bool) -> str:
    """Which reward scores ``data_source`` and how (its rows' prompts chat messages or not: ``chat``), as
    the start-up table shows it."""
    target = _route(scorer, data_source)
    if target is not None:
        return f"{target.label} ({target.mode(chat)})"
    found = resolve_source(data_source)
    family = found[0] if found else "?"
    return f"built-in {family}" + (" then the TinyV verifier" if is_tinyv(data_source) else "")


def scoring_pool(reward: RewardConfig, scorer: Scorer) -> contextlib.AbstractContextManager[ScorePool | None]:
    """``reward.workers`` scoring processes with ``reward.timeout`` per sample; 0 workers: none."""
    if reward.workers == 0:
        return contextlib.nullcontext()
    return ScorePool(scorer, workers=reward.workers, timeout=reward.timeout)


def score(prompts: list[TokenizedPrompt], groups: list[list[Completion]], scorer: Scorer = compute_score,
          pool: ScorePool | None = None, tinyv: TinyVConfig | None = None,
          max_error_rate: float = 1.0) -> list[SampleResult]:
    """Score every completion with the reward of its prompt's data_source (or ``scorer``), in ``pool``
    (worker processes, a per-sample timeout) when given, else in this process; the samples routed to a
    TRL batch function (``rewards.custom``) by one call of it, in this process. Then the samples whose
    data_source ends in ``_tinyv`` go, in one batch, through the TinyV verifier configured by ``tinyv``
    (None: the ``TinyVConfig`` defaults); see ``megareason.rewards.tinyv``.

    A scorer that raises or times out gives reward 0 and is counted (``score_error``, ``timed_out``),
    never silently; the pool logs the first few with their sample ids. So is a TinyV sample the
    verifier gave no verdict (``score_error`` "TinyVFallback: ...", "TinyVFallback (timeout): ...").
    A reward that fails (not a timeout) on more than ``max_error_rate`` of the samples it scores raises
    ``RewardError`` naming it and its first error (``reward.max_error_rate``; 1: never).
    """
    pairs = [(p, j, c) for p, group in zip(prompts, groups, strict=True) for j, c in enumerate(group)]
    requests = [ScoreRequest(p.record.data_source, c.text, p.record.ground_truth, p.record.extra_info,
                             sample_id=f"{p.record.extra_info.get('index', '?')}/{j}", prompt=p.record.prompt,
                             chat=p.record.chat)
                for p, j, c in pairs]
    outcomes = _score_requests(requests, scorer, pool)
    _check_error_rate(requests, outcomes, scorer, max_error_rate)
    outcomes = _verify_tinyv(requests, outcomes, [p.record.prompt[-1]["content"] for p, _, _ in pairs],
                             tinyv if tinyv is not None else TinyVConfig())
    return [SampleResult(
        index=p.record.extra_info.get("index", -1), sample=j, data_source=p.record.data_source,
        question=p.record.prompt[-1]["content"], ground_truth=p.record.ground_truth, response=c.text,
        reward=o.score, correct=o.correct, response_tokens=len(c.token_ids), truncated=c.truncated,
        score_error=o.error, timed_out=o.timed_out, parts=dict(o.parts),
    ) for (p, j, c), o in zip(pairs, outcomes, strict=True)]


def _check_error_rate(requests: list[ScoreRequest], outcomes: list[ScoreOutcome], scorer: Scorer,
                      max_rate: float) -> None:
    """``RewardError`` when a reward (a function of one's own, or a built-in family) failed on more than
    ``max_rate`` of its samples; timeouts do not count (``reward.timeout`` is their limit)."""
    by_reward: dict[str, list[ScoreOutcome]] = defaultdict(list)
    for r, o in zip(requests, outcomes, strict=True):
        target = _route(scorer, r.data_source)
        found = resolve_source(r.data_source) if target is None else None
        by_reward[target.label if target is not None else f"built-in {found[0] if found else r.data_source}"].append(o)
    for label, outs in by_reward.items():
        failed = [o for o in outs if o.error and not o.timed_out]
        if failed and len(failed) / len(outs) > max_rate:
            raise RewardError(f"reward {label} failed on {len(failed)} of its {len(outs)} samples (more than "
                              f"reward.max_error_rate={max_rate:g}): {failed[0].error}")


def _score_requests(requests: list[ScoreRequest], scorer: Scorer, pool: ScorePool | None) -> list[ScoreOutcome]:
    """One outcome per request, in order. Samples routed to a TRL batch function are scored by one call
    of it per function, in this process (``_score_batch``); the others one by one in ``pool`` (or here)."""
    batches: dict[int, tuple[Custom, list[int]]] = {}
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


def _route(scorer: Scorer, data_source: str) -> Custom | None:
    if isinstance(scorer, CustomRewards):
        return scorer.route(data_source)
    return scorer if isinstance(scorer, CustomScorer) else None


def _score_batch(scorer: Custom, requests: list[ScoreRequest]) -> list[ScoreOutcome]:
    """A TRL batch function on ``requests``, one call per prompt format (TRL's conversational rows, its
    standard ones), or each function of a ``WeightedRewards`` in turn, summed with its weights. An
    exception is every sample's error; a None for a sample is that sample's error. Either way counted
    (``score_error``), never a silent 0."""
    if isinstance(scorer, WeightedRewards):
        return _score_weighted(scorer, requests)
    out: list[ScoreOutcome | None] = [None] * len(requests)
    for conversational in (False, True):
        idx = [i for i, r in enumerate(requests) if scorer.conversational(r.chat) == conversational]
        if idx:
            for i, o in zip(idx, _score_one_format(scorer, [requests[i] for i in idx], conversational), strict=True):
                out[i] = o
    return out


def _score_one_format(scorer: CustomScorer, requests: list[ScoreRequest], conversational: bool) -> list[ScoreOutcome]:
    rows = [(r.data_source, r.response, r.ground_truth, r.extra_info, r.prompt) for r in requests]
    try:
        scores = scorer.score_batch(rows, conversational)
    except Exception as e:  # a broken reward must not lose the step; the error is counted instead
        log.warning("reward %s failed on a batch of %d samples: %s: %s", scorer, len(rows), type(e).__name__, e)
        return [ScoreOutcome(score=0.0, correct=False, error=f"{type(e).__name__}: {e}") for _ in rows]
    where = f"{scorer.path}:{scorer.name}"
    return [ScoreOutcome(score=0.0, correct=False, error=f"ValueError: {where} returned None for the sample")
            if v is None else ScoreOutcome(score=v, correct=v >= 1.0) for v in scores]


def _score_weighted(scorer: WeightedRewards, requests: list[ScoreRequest]) -> list[ScoreOutcome]:
    """Each function of ``scorer`` on every request (TRL's ``reward_funcs``): the reward is the weighted sum,
    each function's score kept in ``parts``; a function's failure on a sample is that sample's error (its
    term 0)."""
    per_fn = [_score_batch(p, requests) if p.batch else [score_one(p, r) for r in requests] for p in scorer.parts]
    out = []
    for i in range(len(requests)):
        outs = [fn_out[i] for fn_out in per_fn]
        total = sum(w * o.score for w, o in zip(scorer.weights, outs, strict=True))
        error = next((f"{p.label}: {o.error}" for p, o in zip(scorer.parts, outs, strict=True) if o.error), "")
        out.append(ScoreOutcome(score=total, correct=total >= 1.0, error=error,
                                parts=tuple((n, o.score) for n, o in zip(scorer.names, outs, strict=True))))
    return out


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
