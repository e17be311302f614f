"""``megareason eval``: generate k samples per prompt, score them, report per data_source.

Outputs go to ``<eval.output_dir>/<timestamp>/``: ``samples.jsonl`` (one line per sample) and
``summary.json``, each written to a temporary file and renamed, so a crash never leaves half a file
and earlier runs are never overwritten.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megareason.config.schema import Config
from megareason.data import load_records, tokenize_prompts
from megareason.models.hub import resolve_model_path
from megareason.raro.rerank import rerank
from megareason.rewards.scoring import SampleResult, SourceSummary, score, scorer_from, scoring_pool, summarize
from megareason.rollout import start_engine
from megareason.rollout.records import RolloutEngine
from megareason.settings import engine_settings, policy_data, sampling_from
from megareason.trainer.episodes import check_env_data, env_enabled, hop_rows, run_env
from megareason.utils import atomic_write

log = logging.getLogger(__name__)


@dataclass
class EvalReport:
    summaries: list[SourceSummary]
    samples: list[SampleResult] = field(repr=False)
    output_dir: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    hop_rows: list[dict] = field(default_factory=list)  # env.name=retrieval_qa: the per-hop-count table


def run_eval(cfg: Config, engine: RolloutEngine | None = None, write: bool = True) -> EvalReport:
    """Evaluate ``cfg.model`` on ``cfg.data``; starts (and stops) a vLLM engine unless one is given.
    With an environment (``env.name``) each sample is a multi-turn episode the environment scores."""
    t0 = time.perf_counter()
    # data and reward errors surface before the engine starts
    records = load_records(policy_data(cfg), any_source=bool(cfg.reward.custom or cfg.reward.funcs))
    scorer = scorer_from(cfg.reward, records)
    if env_enabled(cfg):
        check_env_data(cfg, records)
    own_engine = engine is None
    if own_engine:
        resolve_model_path(cfg.model.path)  # a Hub model: fetched into the cache the engine reads
        engine = start_engine(engine_settings(cfg))
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
            picks = rerank(engine, prompts, groups, cfg.raro, seed=cfg.rollout.seed,
                           max_prompt_tokens=cfg.rollout.max_model_len - cfg.raro.critic_max_tokens)
        t2 = time.perf_counter()
    finally:
        if own_engine:
            engine.shutdown()
    if env_samples is not None:  # the environments scored their episodes
        samples = env_samples
    else:
        with scoring_pool(cfg.reward, scorer) as pool:
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
