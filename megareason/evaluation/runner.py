"""``megareason eval``: generate k samples per prompt, score them, report per data_source.

Outputs go to ``<eval.output_dir>/<timestamp>/``: ``samples.jsonl`` (one line per sample) and
``summary.json``, each written to a temporary file and renamed, so a crash never leaves half a file
and earlier runs are never overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megareason.config.schema import Config, TinyVConfig
from megareason.data import DataError, PromptRecord, TokenizedPrompt, load_records, tokenize_prompts
from megareason.evaluation.metrics import pass_at_k
from megareason.models.hub import resolve_model_path
from megareason.raro.prompts import policy_data
from megareason.raro.rerank import rerank
from megareason.rewards import compute_score, get_reward_fn
from megareason.rewards.custom import Scorer, load_custom
from megareason.rewards.pool import ScoreOutcome, ScorePool, ScoreRequest, score_one
from megareason.rewards.tinyv import apply_tinyv, is_tinyv
from megareason.rollout.engine import Completion, EngineSettings, RolloutEngine, Sampling, VLLMEngine
from megareason.utils import atomic_write

log = logging.getLogger(__name__)


@dataclass
class SampleResult:
    index: int
    sample: int
    data_source: str
    question: str
    ground_truth: str
    response: str
    reward: float
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


@dataclass
class EvalReport:
    summaries: list[SourceSummary]
    samples: list[SampleResult] = field(repr=False)
    output_dir: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    hop_rows: list[dict] = field(default_factory=list)  # env.name=retrieval_qa: the per-hop-count table


def engine_settings(cfg: Config) -> EngineSettings:
    r = cfg.rollout
    return EngineSettings(
        model_path=str(resolve_model_path(cfg.model.path)),
        tokenizer=str(resolve_model_path(cfg.model.tokenizer)) if cfg.model.tokenizer else "",
        dtype=r.dtype,
        max_model_len=r.max_model_len,
        kv_cache_gib=r.kv_cache_gib,
        gpu_memory_utilization=r.gpu_memory_utilization,
        tensor_parallel_size=r.tensor_parallel_size,
        enforce_eager=r.enforce_eager,
        seed=r.seed,
    )


def sampling_from(cfg: Config) -> Sampling:
    r = cfg.rollout
    return Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                    stop=tuple(r.stop))


def run_eval(cfg: Config, engine: RolloutEngine | None = None, write: bool = True) -> EvalReport:
    """Evaluate ``cfg.model`` on ``cfg.data``; starts (and stops) a vLLM engine unless one is given.
    With an environment (``env.name``) each sample is a multi-turn episode the environment scores."""
    from megareason.envs.runner import check_env_data, env_enabled, hop_rows, run_env

    t0 = time.perf_counter()
    records = load_records(policy_data(cfg))  # data and reward errors surface before the engine starts
    scorer = scorer_from(cfg, records)
    if env_enabled(cfg):
        check_env_data(cfg, records)
    own_engine = engine is None
    if own_engine:
        engine = VLLMEngine(engine_settings(cfg))
    try:
        t1 = time.perf_counter()
        prompts = tokenize_prompts(records, engine.tokenizer, cfg.data.max_prompt_length, cfg.data.truncation)
        log.info("generating %d x %d samples", len(prompts), cfg.rollout.n)
        env_samples = None
        if env_enabled(cfg):
            generate = lambda ctxs, sp: engine.generate(ctxs, sp, use_tqdm=False)  # noqa: E731
            prompts, groups, env_samples = run_env(cfg, prompts, generate, engine.tokenizer, sampling_from(cfg))
        else:
            groups = engine.generate([p.token_ids for p in prompts], sampling_from(cfg))
        picks = None
        if cfg.eval.rerank == "critic":
            log.info("critic tournament over %d x %d answers", len(prompts), cfg.rollout.n)
            picks = rerank(engine, prompts, groups, cfg.raro, seed=cfg.rollout.seed)
        t2 = time.perf_counter()
    finally:
        if own_engine:
            engine.shutdown()
    if env_samples is not None:  # the environments scored their episodes
        samples = env_samples
    else:
        with scoring_pool(cfg, scorer) as pool:
            samples = score(prompts, groups, scorer, pool, tinyv=cfg.reward.tinyv)
    t3 = time.perf_counter()
    report = EvalReport(
        summaries=summarize(samples, cfg.rollout.n, cfg.eval.pass_k, picks),
        samples=samples,
        seconds={"setup": t1 - t0, "generate": t2 - t1, "score": t3 - t2},
        hop_rows=hop_rows(samples) if env_samples is not None else [],
    )
    if write:
        report.output_dir = write_report(report, cfg)
    return report


def scorer_from(cfg: Config, records: Iterable[PromptRecord] = ()) -> Scorer:
    """The configured custom reward, else the registry (by data_source). Every data_source of
    ``records`` must have a registered reward: checked here, at start-up, not mid-run."""
    if cfg.reward.custom:
        return load_custom(cfg.reward.custom)
    for source in sorted({r.data_source for r in records}):
        try:
            get_reward_fn(source)
        except ValueError as e:
            raise DataError(f"no reward for the data: {e} (or set reward.custom=file.py:function)") from None
    return compute_score


def score(prompts: list[TokenizedPrompt], groups: list[list[Completion]], scorer: Scorer = compute_score,
          pool: ScorePool | None = None, tinyv: TinyVConfig | None = None) -> list[SampleResult]:
    """Score every completion with the reward of its prompt's data_source (or ``scorer``), in ``pool``
    (worker processes, a per-sample timeout) when given, else in this process. Then the samples whose
    data_source ends in ``_tinyv`` go, in one batch, through the TinyV verifier configured by ``tinyv``
    (None: the ``TinyVConfig`` defaults); see ``megareason.rewards.tinyv``.

    A scorer that raises or times out gives reward 0 and is counted (``score_error``, ``timed_out``),
    never silently; the pool logs the first few with their sample ids. So is a TinyV sample the
    verifier gave no verdict (``score_error`` "TinyVFallback: ...").
    """
    pairs = [(p, j, c) for p, group in zip(prompts, groups, strict=True) for j, c in enumerate(group)]
    requests = [ScoreRequest(p.record.data_source, c.text, p.record.ground_truth, p.record.extra_info,
                             sample_id=f"{p.record.extra_info.get('index', '?')}/{j}") for p, j, c in pairs]
    outcomes = pool.score(requests) if pool is not None else [score_one(scorer, r) for r in requests]
    outcomes = _verify_tinyv(requests, outcomes, [p.record.prompt[-1]["content"] for p, _, _ in pairs],
                             tinyv if tinyv is not None else TinyVConfig())
    return [SampleResult(
        index=p.record.extra_info.get("index", -1), sample=j, data_source=p.record.data_source,
        question=p.record.prompt[-1]["content"], ground_truth=p.record.ground_truth, response=c.text,
        reward=o.score, correct=o.correct, response_tokens=len(c.token_ids), truncated=c.truncated,
        score_error=o.error, timed_out=o.timed_out,
    ) for (p, j, c), o in zip(pairs, outcomes, strict=True)]


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
    log.info("TinyV (%s): %d samples, %d asked, %d upgraded, %d fallbacks", cfg.mode, len(idx), stats["asked"],
             stats["upgraded"], stats["fallbacks"])
    out = list(outcomes)
    for i, o in zip(idx, rescored, strict=True):
        out[i] = o
    return out


def scoring_pool(cfg: Config, scorer: Scorer) -> contextlib.AbstractContextManager[ScorePool | None]:
    """``reward.workers`` scoring processes with ``reward.timeout`` per sample; 0 workers: none."""
    if cfg.reward.workers == 0:
        return contextlib.nullcontext()
    return ScorePool(scorer, workers=cfg.reward.workers, timeout=cfg.reward.timeout)


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


def format_table(summaries: list[SourceSummary]) -> str:
    ks = sorted({k for s in summaries for k in s.pass_at})
    reranked = any(s.rerank_accuracy is not None for s in summaries)
    header = ["data_source", "prompts", "samples", "accuracy", *[f"pass@{k}" for k in ks],
              *(["critic@n"] if reranked else []), "reward", "resp_len", "clipped", "errors"]
    rows = [[s.data_source, str(s.prompts), str(s.samples), f"{s.accuracy:.3f}",
             *[f"{s.pass_at[k]:.3f}" for k in ks], *([f"{s.rerank_accuracy:.3f}"] if reranked else []),
             f"{s.mean_reward:.3f}", f"{s.mean_response_tokens:.0f}", f"{s.clip_ratio:.2f}", str(s.score_errors)]
            for s in summaries]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def write_report(report: EvalReport, cfg: Config) -> Path:
    out = Path(cfg.eval.output_dir) / time.strftime("%Y%m%d-%H%M%S")
    while out.exists():  # two runs in the same second
        out = out.with_name(out.name + "_")
    out.mkdir(parents=True)
    atomic_write(out / "samples.jsonl", "".join(json.dumps(asdict(s)) + "\n" for s in report.samples))
    summary = {"summaries": [asdict(s) for s in report.summaries], "seconds": report.seconds,
               "config": asdict(cfg)}
    if report.hop_rows:
        summary["hop_rows"] = report.hop_rows
    atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return out
