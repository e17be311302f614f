"""The per-hop table and `megareason analyze` on hand-made results (figures computed by hand)."""

import json
import subprocess
import sys

import pytest
from matplotlib.container import BarContainer, ErrorbarContainer
from test_plots import error_bars, wilson_by_hand

from megareason.evaluation.benchmark import analyze, figures, load_results, run_name, tables
from megareason.rewards.scoring import SampleResult
from megareason.trainer.episodes import format_rows, hop_rows


def sample(index, hops, em, f1, recall, end="done", searches=1, reward=None):
    return SampleResult(index=index, sample=0, data_source="musique", question="q", ground_truth="a", response="r",
                        reward=em if reward is None else reward, correct=em == 1, response_tokens=5, truncated=False,
                        env={"hops": hops, "em": em, "f1": f1, "retrieval_recall": recall, "retrieval_precision": 0.5,
                             "citation_precision": 0.0, "searches": searches, "tool_errors": 0, "turns": 2,
                             "end": end})


def test_hop_rows_by_hand():
    rows = hop_rows([sample(0, 2, 1.0, 1.0, 1.0), sample(1, 2, 0.0, 0.5, 0.5, end="turn_limit", searches=3),
                     sample(2, 3, 0.0, 0.25, 1 / 3)])
    assert [r["hops"] for r in rows] == ["2", "3", "all"]
    two, three, both = rows
    assert (two["questions"], two["em"], two["f1"], two["retrieval_recall"], two["answered"], two["searches"]) == \
        (2, 0.5, 0.75, 0.75, 0.5, 2.0)
    assert (three["em"], three["f1"]) == (0.0, 0.25)
    assert both["samples"] == 3 and both["f1"] == pytest.approx((1 + 0.5 + 0.25) / 3)
    text = format_rows(rows)
    assert text.splitlines()[0].split()[:4] == ["hops", "questions", "samples", "reward"]
    assert text.splitlines()[2].split()[:3] == ["2", "2", "2"]


def _write_run(root, model, retriever, rows):
    folder = root / run_name(model, retriever)
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"model": model, "retriever": retriever, "hop_rows": rows}))


def test_analyze_tables_and_plots(tmp_path):
    res = tmp_path / "results"
    a = hop_rows([sample(0, 2, 1.0, 1.0, 1.0), sample(1, 3, 0.0, 0.5, 0.5)])
    b = hop_rows([sample(0, 2, 0.0, 0.0, 0.0), sample(1, 3, 1.0, 1.0, 1.0)])
    _write_run(res, "/models/x/", "bm25", a)
    _write_run(res, "/models/x/", "golden", b)
    _write_run(res, "smollm2-135m-instruct", "bm25", b)
    assert run_name("/models/x/", "bm25") == "models_x__bm25"
    overall, by_hop = tables(load_results(res))
    assert [(r["model"], r["retriever"], r["em"]) for r in overall] == [
        ("/models/x/", "bm25", 0.5), ("/models/x/", "golden", 0.5), ("smollm2-135m-instruct", "bm25", 0.5)]
    assert [(r["hops"], r["f1"]) for r in by_hop[:2]] == [("2", 1.0), ("3", 0.5)]
    text, plots = analyze(res)
    assert "by hop count:" in text and text.count("golden") == 3  # one overall row, two hop rows
    assert sorted(p.name for p in plots) == ["em.png", "f1.png", "f1_by_hops.png", "retrieval_recall.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    cli = subprocess.run([sys.executable, "-m", "megareason.cli", "analyze", str(res)], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0 and "by hop count:" in cli.stdout, cli.stderr

    # One metric per figure; exact match (a proportion of each run's 2 questions) with its Wilson interval
    figs = figures(overall, by_hop)
    assert list(figs) == ["em", "f1", "retrieval_recall", "f1_by_hops"]
    assert all(len(fig.axes) == 1 for fig in figs.values())
    (em,) = figs["em"].axes
    assert em.get_ylabel() == "em" and [type(c) for c in em.containers] == [BarContainer, ErrorbarContainer]
    assert error_bars(em) == pytest.approx([0, *wilson_by_hand(1, 2), 1, *wilson_by_hand(1, 2),
                                               2, *wilson_by_hand(1, 2)])
    assert "95% Wilson score interval over each run's questions (n=2)" in figs["em"].get_supxlabel()
    for name in ("f1", "retrieval_recall", "f1_by_hops"):  # means of scores, not proportions: no interval
        (ax,) = figs[name].axes
        assert ax.containers and all(isinstance(c, BarContainer) for c in ax.containers)
        assert figs[name].get_supxlabel().startswith("No interval")



def test_analyze_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such results folder"):
        load_results(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no \\*/summary.json"):
        load_results(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"model": "m"}')
    with pytest.raises(ValueError, match="run/summary.json: not a benchmark run summary"):
        load_results(tmp_path)
    cli = subprocess.run([sys.executable, "-m", "megareason.cli", "analyze", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 2 and "not a benchmark run summary" in cli.stderr
