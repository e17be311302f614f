"""Environments as the trainer and the evaluator use them: prompts in, scored samples out.

``run_env`` turns a batch of tokenized prompts into rollout.n episodes each (``envs.rollout``) and
returns what single-turn generation returns: the prompts as the model saw them (system prompt and
tool descriptions included), the completions grouped per prompt (``Completion.mask_T`` marks the
model's own tokens), and ``SampleResult`` rows scored by the environment. ``hop_table`` is the
per-hop-count table ``megareason eval`` prints for multi-hop QA.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from megareason.config.schema import Config
from megareason.data.musique import documents_of
from megareason.data.records import DataError, TokenizedPrompt
from megareason.envs.retrieval_qa import make_envs
from megareason.envs.rollout import GenerateFn, run_episodes
from megareason.rewards.scoring import SampleResult, scorer_from
from megareason.rollout.records import Completion, Sampling
from megareason.settings import retrieval_qa_settings


def env_enabled(cfg: Config) -> bool:
    return cfg.env.name != "none"


def check_env_data(cfg: Config, records: Iterable) -> None:
    """Every record must carry the documents the environment searches (fail before any engine starts)."""
    for rec in records:
        try:
            documents_of(rec, f"row {rec.extra_info.get('index', '?')} ({rec.data_source})")
        except ValueError as e:
            raise DataError(f"env.name={cfg.env.name}: {e}") from None


def run_env(cfg: Config, prompts: list[TokenizedPrompt], generate: GenerateFn, tokenizer,
            sampling: Sampling) -> tuple[list[TokenizedPrompt], list[list[Completion]], list[SampleResult]]:
    n = sampling.n
    envs = make_envs([p.record for p in prompts], n, retrieval_qa_settings(cfg), scorer_from(cfg.reward))
    episodes = run_episodes(envs, generate, tokenizer, sampling, max_turns=cfg.env.max_turns,
                            max_model_len=cfg.rollout.max_model_len)
    seen, groups, samples = [], [], []
    for i, p in enumerate(prompts):
        mine = episodes[i * n:(i + 1) * n]
        ids = mine[0].prompt_ids
        seen.append(TokenizedPrompt(record=p.record, text=tokenizer.decode(ids, skip_special_tokens=False),
                                    token_ids=ids))
        groups.append([e.completion for e in mine])
        for j, e in enumerate(mine):
            c = e.completion
            samples.append(SampleResult(
                index=p.record.extra_info.get("index", -1), sample=j, data_source=p.record.data_source,
                question=p.record.prompt[-1]["content"], ground_truth=p.record.ground_truth,
                response=c.text, reward=e.result.reward, correct=e.result.correct,
                response_tokens=sum(c.mask_T), truncated=c.truncated, score_error=e.result.info.get("score_error", ""),
                env={"turns": e.turns, "end": e.end, **e.result.info}))
    return seen, groups, samples


HOP_COLUMNS = ("em", "f1", "retrieval_recall", "retrieval_precision", "citation_precision", "searches",
               "tool_errors", "turns")


def hop_rows(samples: Iterable[SampleResult]) -> list[dict]:
    """Per hop count (and "all"): questions, samples, reward and the means of ``HOP_COLUMNS``."""
    by_hops: dict[str, list[SampleResult]] = defaultdict(list)
    for s in samples:
        by_hops[str(s.env.get("hops", "?"))].append(s)
        by_hops["all"].append(s)
    rows = []
    for hops in sorted(by_hops, key=lambda h: (h == "all", h)):
        rs = by_hops[hops]
        row = {"hops": hops, "questions": len({s.index for s in rs}), "samples": len(rs),
               "reward": sum(s.reward for s in rs) / len(rs),
               "answered": sum(s.env.get("end") == "done" for s in rs) / len(rs)}
        for col in HOP_COLUMNS:
            row[col] = sum(float(s.env.get(col, 0.0)) for s in rs) / len(rs)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain aligned text table of dict rows (floats to 3 decimals)."""
    if not rows:
        return "(no rows)"
    header = list(rows[0])
    cells = [[f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in header] for r in rows]
    widths = [max(len(x) for x in [h, *(c[i] for c in cells)]) for i, h in enumerate(header)]
    line = lambda xs: "  ".join(x.ljust(w) if i == 0 else x.rjust(w)  # noqa: E731
                                for i, (x, w) in enumerate(zip(xs, widths, strict=True)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])
