"""``megareason benchmark`` (models x retrievers on an environment) and ``megareason analyze RESULTS``.

A benchmark evaluates every model of ``benchmark.models`` with every retriever of
``benchmark.retrievers`` on the configured environment and data, one vLLM engine per model. Each
combination is written to ``<benchmark.output_dir>/<model>__<retriever>/`` (``summary.json``,
``samples.jsonl``) as soon as it finishes, atomically; a rerun skips the combinations already there,
so a crash loses at most the one in progress. ``analyze`` reads such a folder back, prints the tables
(overall and per hop count) and saves bar plots, exact match with its 95% Wilson score interval.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from megareason.config import ConfigError
from megareason.config.schema import Config
from megareason.data.records import DataError
from megareason.plotting import caption, counts_text, panel_grid, save, wilson_interval
from megareason.utils import OutputKind, atomic_write, check_replaceable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

# One combination's folder: samples.jsonl, then summary.json (atomic_write's temporary files beside them).
BENCHMARK_RUN = OutputKind("benchmark result folder", marks=(),
                           entries=("samples.jsonl", "summary.json", ".samples.jsonl.*", ".summary.json.*"))
METRICS = ("em", "f1", "retrieval_recall", "citation_precision", "searches", "answered")


def run_name(model: str, retriever: str) -> str:
    """A folder name for one combination: the model's path or name, made filesystem-safe."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/")).strip("_")[-80:]
    return f"{model}__{retriever}"


def run_benchmark(cfg: Config) -> Path:
    """Evaluate every (model, retriever) pair; returns the results folder."""
    from megareason.evaluation.runner import run_eval
    from megareason.rollout import start_engine
    from megareason.settings import engine_settings
    from megareason.trainer.episodes import env_enabled

    b = cfg.benchmark
    if not env_enabled(cfg):
        raise ConfigError("benchmark needs an environment: set env.name (e.g. env.name=retrieval_qa)")
    models = b.models or [cfg.model.path]
    out = Path(b.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(m, r) for m in models for r in b.retrievers if not (out / run_name(m, r) / "summary.json").is_file()]
    for m, r in todo:  # before any engine starts: a folder of someone else's under that name is left alone
        check_replaceable(out / run_name(m, r), BENCHMARK_RUN)
    if len(todo) < len(models) * len(b.retrievers):
        log.info("%d of %d combinations already in %s; running the other %d", len(models) * len(b.retrievers)
                 - len(todo), len(models) * len(b.retrievers), out, len(todo))
    bar = tqdm(total=len(todo), desc="benchmark", unit="run")
    for model in dict.fromkeys(m for m, _ in todo):
        model_cfg = replace(cfg, model=replace(cfg.model, path=model))
        engine = start_engine(engine_settings(model_cfg))
        try:
            for m, retriever in todo:
                if m != model:
                    continue
                run_cfg = replace(model_cfg, env=replace(cfg.env, retriever=retriever))
                bar.set_postfix_str(run_name(model, retriever))
                report = run_eval(run_cfg, engine=engine, write=False)
                _write_run(out / run_name(model, retriever), model, retriever, report, run_cfg)
                bar.update()
        finally:
            engine.shutdown()
    bar.close()
    return out


def _write_run(folder: Path, model: str, retriever: str, report, cfg: Config) -> None:
    check_replaceable(folder, BENCHMARK_RUN)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "samples.jsonl", "".join(json.dumps(asdict(s)) + "\n" for s in report.samples))
    summary = {"model": model, "retriever": retriever, "hop_rows": report.hop_rows,
               "summaries": [asdict(s) for s in report.summaries], "seconds": report.seconds,
               "config": asdict(cfg)}
    atomic_write(folder / "summary.json", json.dumps(summary, indent=2) + "\n")  # last: marks the run done


def load_results(results: str | Path) -> list[dict]:
    """Every finished run's summary in ``results`` (sorted by model, retriever)."""
    root = Path(results)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such results folder (megareason benchmark writes one)")
    runs = []
    for path in sorted(root.glob("*/summary.json")):
        try:
            s = json.loads(path.read_text())
            s["model"], s["retriever"], s["hop_rows"]  # noqa: B018 - the keys analyze needs
        except (json.JSONDecodeError, KeyError) as e:
            raise DataError(f"{path}: not a benchmark run summary ({type(e).__name__}: {e})") from None
        runs.append(s)
    if not runs:
        raise FileNotFoundError(f"{root}: no */summary.json; is it a megareason benchmark folder?")
    return sorted(runs, key=lambda s: (s["model"], s["retriever"]))


def tables(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(overall rows: one per run; per-hop rows: one per run and hop count)."""
    overall, by_hop = [], []
    for s in runs:
        for row in s["hop_rows"]:
            hops = {} if row["hops"] == "all" else {"hops": row["hops"]}
            keyed = {"model": s["model"], "retriever": s["retriever"], **hops, "questions": row["questions"],
                     **{k: float(row[k]) for k in METRICS}}
            (overall if row["hops"] == "all" else by_hop).append(keyed)
    return overall, by_hop


def analyze(results: str | Path) -> tuple[str, list[Path]]:
    """The tables as text and the plots written to ``<results>/plots/``."""
    from megareason.trainer.episodes import format_rows

    runs = load_results(results)
    overall, by_hop = tables(runs)
    text = "overall:\n" + format_rows(overall) + "\n\nby hop count:\n" + format_rows(by_hop)
    return text, _plots(Path(results) / "plots", overall, by_hop)


def _plots(out: Path, overall: list[dict], by_hop: list[dict]) -> list[Path]:
    out.mkdir(exist_ok=True)
    return [save(fig, out / f"{name}.png") for name, fig in figures(overall, by_hop).items()]


# What each bar plot shows of its metric: exact match is a proportion of questions (a Wilson interval);
# F1 and retrieval recall are means of per-question scores in [0, 1] (no interval is drawn for them).
PLOTTED = {"em": "exact match", "f1": "answer F1", "retrieval_recall": "retrieval recall"}


def figures(overall: list[dict], by_hop: list[dict]) -> dict[str, Figure]:
    """{file stem: Figure}: one bar plot per metric of ``PLOTTED`` (a bar per model and retriever), and F1
    by hop count (``f1_by_hops``)."""
    figs = {}
    labels = [f"{r['model']}\n{r['retriever']}" for r in overall]
    x = range(len(overall))
    for metric, name in PLOTTED.items():
        fig, (ax,) = panel_grid([f"{name} by model and retriever"], sharex=False,
                                panel_size=(max(5.0, 1.6 * len(overall)), 3.6))
        values = [r[metric] for r in overall]
        ax.bar(x, values, color="tab:blue")
        if metric == "em":
            lows, highs = zip(*(wilson_interval(r["em"] * r["questions"], r["questions"]) for r in overall),
                              strict=True)
            ax.errorbar(x, values, yerr=[[v - lo for v, lo in zip(values, lows, strict=True)],
                                         [hi - v for v, hi in zip(values, highs, strict=True)]],
                        fmt="none", ecolor="black", capsize=4)
            caption(fig, [f"Error bars: 95% Wilson score interval over each run's questions "
                          f"({counts_text([r['questions'] for r in overall])})."])
        else:
            caption(fig, [f"No interval: {name} is a mean of per-question scores in [0, 1], not a proportion."])
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(metric, fontsize=8)
        ax.set_ylim(0, max(1.0, max(values, default=1.0)))
        figs[metric] = fig
    hops = sorted({r["hops"] for r in by_hop})
    runs = list(dict.fromkeys((r["model"], r["retriever"]) for r in by_hop))
    if hops and runs:
        fig, (ax,) = panel_grid(["answer F1 by hop count"], sharex=False,
                                panel_size=(max(5.0, 1.2 * len(hops) * len(runs)), 3.6))
        width = 0.8 / len(runs)
        for i, (model, retriever) in enumerate(runs):
            vals = {r["hops"]: r["f1"] for r in by_hop if (r["model"], r["retriever"]) == (model, retriever)}
            ax.bar([h + i * width for h in range(len(hops))], [vals.get(h, 0.0) for h in hops], width,
                   label=f"{Path(model).name} / {retriever}")
        ax.set_xticks([h + width * (len(runs) - 1) / 2 for h in range(len(hops))], [f"{h} hops" for h in hops])
        ax.set_ylabel("f1", fontsize=8)
        ax.legend(fontsize=7)
        caption(fig, ["No interval: answer F1 is a mean of per-question scores in [0, 1], not a proportion."])
        figs["f1_by_hops"] = fig
    return figs
