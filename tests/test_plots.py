"""megareason report's figures on a run folder written by hand, and the Wilson score interval: the figures'
structure (one metric per panel, whole-step ticks, validation accuracy with its interval), not pixels."""

from __future__ import annotations

import json
import math

import matplotlib
import pytest
from matplotlib.container import ErrorbarContainer

from megareason.plotting import wilson_interval
from megareason.trainer.report import figures, render

matplotlib.use("Agg")


def wilson_by_hand(k: float, n: int) -> tuple[float, float]:
    """(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n), z = 1.96 (the 95% normal quantile)."""
    z, p = 1.959963984540054, k / n
    center, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (center - half) / (1 + z * z / n), (center + half) / (1 + z * z / n)


def test_wilson_interval_by_hand():
    # k = 0: the lower end is 0 and the upper z²/(n + z²) (the closed form at the boundary)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 1.959963984540054**2 / (10 + 1.959963984540054**2)))
    assert wilson_interval(10, 10) == pytest.approx((1 - 3.8414588 / 13.8414588, 1.0))
    # k = n/2: symmetric about 1/2; 1 of 2: 0.5 ± 1.96·sqrt(1/8 + 3.8415/16) / 2.9207 = 0.5 ± 0.4055
    lo, hi = wilson_interval(1, 2)
    assert (lo, hi) == pytest.approx((0.5 - 0.40548, 0.5 + 0.40548), abs=1e-4)
    assert wilson_interval(81, 263) == pytest.approx(wilson_by_hand(81, 263))
    assert wilson_interval(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)  # published example
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(3, 2)


def error_bars(ax) -> list[float]:
    """x, low, high of each vertical error bar on ``ax`` (its one set of error bars), one after the other."""
    (container,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    _, _, (bars,) = container.lines
    return [float(v) for seg in bars.get_segments() for v in (seg[0][0], seg[0][1], seg[1][1])]


def _run(tmp_path, val_dumps=(0, 2, 3), prompts=8):
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    rows = [{"step": 0, "val/accuracy": 0.25}]
    for s in (1, 2, 3):
        rows.append({"step": s, "reward/mean": 0.1 * s, "accuracy": 0.2 * s, "actor/kl": 0.001 * s,
                     "actor/pg_loss": -0.5 + s, "time/step": 2.0 + s, "raro/critic_accuracy": 0.6})
    rows[2]["val/accuracy"] = 0.5
    rows[3]["val/accuracy"] = 0.625
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    correct = {0: 2, 2: 4, 3: 5}
    for s in val_dumps:
        (run / "rollouts" / f"val_step_{s:08d}.jsonl").write_text(
            "".join(json.dumps({"index": i, "correct": i < correct[s]}) + "\n" for i in range(prompts)))
    (run / "rollouts" / "step_00000001.jsonl").write_text('{"correct": true}\n')  # training rows: not counted
    return run


def test_report_one_metric_per_panel_on_whole_steps(tmp_path):
    run = _run(tmp_path)
    figs = figures(run)
    assert set(figs) == {"reward", "policy", "time", "raro"}
    for name, fig in figs.items():
        for ax in fig.axes:  # one panel per metric, titled and labelled with it, one series each
            assert len(ax.lines) == 1, (name, ax.get_title())
            assert ax.get_title() and ax.get_ylabel() and ax.get_xlabel() == "step"
            assert all(float(t).is_integer() for t in ax.get_xticks()), (name, ax.get_xticks())
            assert all(float(t).is_integer() for t in ax.xaxis.get_major_locator().tick_values(1, 3))
    assert [ax.get_title() for ax in figs["policy"].axes] == ["actor/pg_loss", "actor/kl"]
    assert [ax.get_title() for ax in figs["reward"].axes] == ["reward/mean", "accuracy", "val/accuracy"]
    assert figs["time"].axes[0].get_ylabel() == "seconds"

    # val/accuracy: k of 8 prompts correct at steps 0, 2, 3 (the dumps' rows): the Wilson interval of k/8
    val = figs["reward"].axes[2]
    assert error_bars(val) == pytest.approx([0, *wilson_by_hand(2, 8), 2, *wilson_by_hand(4, 8),
                                             3, *wilson_by_hand(5, 8)])
    assert [ax.containers for ax in figs["reward"].axes[:2]] == [[], []]  # training metrics: no interval
    note = figs["reward"].get_supxlabel()
    assert "95% Wilson score interval over the n=8 validation prompts" in note
    assert "accuracy: on each step's training batch; no interval drawn." in note
    assert "no interval drawn" in figs["raro"].get_supxlabel()

    written = render(run)
    assert sorted(p.name for p in written) == ["policy.png", "raro.png", "reward.png", "time.png"]
    assert all(p.stat().st_size > 1000 for p in written) and not list((run / "plots").glob(".*"))


def test_report_without_the_prompt_count_draws_no_interval_and_says_so(tmp_path):
    figs = figures(_run(tmp_path, val_dumps=(0, 2)))  # step 3's dump is missing
    val = figs["reward"].axes[2]
    assert len(val.lines) == 1  # the accuracy at every step, one line
    assert error_bars(val)[::3] == [0, 2]  # intervals only where n is known
    assert "no interval at step(s) 3" in figs["reward"].get_supxlabel()
    figs = figures(_run(tmp_path / "none", val_dumps=()))
    val = figs["reward"].axes[2]
    assert val.containers == [] and len(val.lines) == 1
    assert "Wilson" not in figs["reward"].get_supxlabel()
    assert "no interval at step(s) 0, 2, 3" in figs["reward"].get_supxlabel()


def test_an_accuracy_of_0_or_1_draws_a_one_sided_interval():
    """At k = 0 the Wilson low bound is 0 up to rounding (0/6: 2.8e-17 above it), at k = n the high bound
    1: matplotlib refuses a negative error bar, so the bars are clipped at the point."""
    from megareason.plotting import accuracy_with_interval, panel_grid

    fig, (ax,) = panel_grid(["val/accuracy"])
    bars = accuracy_with_interval(ax, [0, 1, 2], [0.0, 1.0, 0.5], [6, 6, 6])
    segments = bars.lines[2][0].get_segments()
    lo, hi = wilson_interval(0, 6)
    assert segments[0][0][1] == 0.0 and segments[0][1][1] == pytest.approx(hi)
    lo, hi = wilson_interval(6, 6)
    assert segments[1][0][1] == pytest.approx(lo) and segments[1][1][1] == 1.0
