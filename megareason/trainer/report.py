"""``megareason report RUN_DIR``: the curves of a training run as PNG plots (from metrics.jsonl).

Each figure is a grid of small panels, one metric per panel, against whole training steps. The greedy
validation accuracy is drawn with its 95% Wilson score interval, n being the number of validation
prompts of that step (the rows of ``rollouts/val_step_N.jsonl``); where that file is missing the point
has no interval and the figure's caption says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megareason.plotting import accuracy_with_interval, caption, counts_text, integer_steps, panel_grid, save
from megareason.trainer.tracking import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# One figure per entry (``plots/<name>.png``); one panel per metric of the figure that the run logged.
PANELS = {
    "reward": ("reward/mean", "accuracy", "val/accuracy"),
    "sft": ("sft/loss", "val/loss"),
    "response_length": ("response_length/mean", "response_length/max"),
    "policy": ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/clipfrac", "actor/ppo_kl"),
    "grad_norm": ("actor/grad_norm", "critic/grad_norm"),
    "critic": ("critic/vf_loss", "critic/vpred", "critic/explained_variance", "critic/returns_var"),
    "mismatch": ("rollout/token_mult_prob_error",),
    "raro": ("raro/critic_accuracy", "raro/tie_rate", "raro/format_error_rate", "raro/policy_fool_rate",
             "raro/expert_win_rate"),
    "raro_buffer": ("raro/buffer_size", "raro/critic_fresh", "raro/critic_historical"),
    "time": ("time/generate", "time/reward", "time/critic", "time/logprobs", "time/train", "time/sync",
             "time/step"),
}
VAL_ACCURACY = "val/accuracy"  # greedy accuracy on the validation prompts: the one drawn with an interval
UNITS = {"time/": "seconds", "response_length/": "tokens"}


def validation_prompts(run_dir: str | Path) -> dict[int, int]:
    """{step: number of validation prompts} from ``rollouts/val_step_N.jsonl`` (one row per prompt:
    validation samples one greedy answer each)."""
    out = {}
    for path in (Path(run_dir) / "rollouts").glob("val_step_*.jsonl"):
        step = path.stem.rsplit("_", 1)[1]
        if step.isdigit():
            out[int(step)] = sum(1 for line in path.read_text().splitlines() if line.strip())
    return {s: n for s, n in out.items() if n > 0}


def figures(run_dir: str | Path) -> dict[str, Figure]:
    """{figure name: matplotlib Figure} for each entry of ``PANELS`` the run has data for."""
    records = read_metrics(run_dir)
    prompts = validation_prompts(run_dir)
    out = {}
    for name, keys in PANELS.items():
        series = {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, axes = panel_grid(list(series))
        fig.suptitle(f"{Path(run_dir).name}: {name}", fontsize=10)
        notes = []
        for ax, (key, points) in zip(axes, series.items(), strict=True):
            steps, values = zip(*points, strict=True)
            marker = "o" if len(points) < 30 else None
            if key == VAL_ACCURACY:
                notes += _validation_panel(ax, steps, values, prompts)
            else:
                ax.plot(steps, values, marker=marker, markersize=3, color="tab:blue")
                if key.endswith("accuracy"):
                    notes.append(f"{key}: on each step's training batch; no interval drawn.")
            ax.set_ylabel(next((u for p, u in UNITS.items() if key.startswith(p)), key), fontsize=8)
            integer_steps(ax)
        caption(fig, notes)
        out[name] = fig
    return out


def _validation_panel(ax, steps, values, prompts: dict[int, int]) -> list[str]:
    """val/accuracy with a Wilson interval at each step whose prompt count is known; the caption lines."""
    known = [i for i, s in enumerate(steps) if s in prompts]
    if len(known) == len(steps):
        accuracy_with_interval(ax, steps, values, [prompts[s] for s in steps], color="tab:green")
    else:
        ax.plot(steps, values, marker="o", markersize=3, color="tab:green")
        if known:
            accuracy_with_interval(ax, [steps[i] for i in known], [values[i] for i in known],
                                   [prompts[steps[i]] for i in known], fmt="none", ecolor="tab:green")
    notes = []
    if known:
        n = counts_text([prompts[steps[i]] for i in known])
        notes.append(f"{VAL_ACCURACY}: error bars are the 95% Wilson score interval over the {n} validation "
                     "prompts of each step (rollouts/val_step_N.jsonl).")
    if len(known) < len(steps):
        missing = [s for s in steps if s not in prompts]
        notes.append(f"{VAL_ACCURACY}: no interval at step(s) {', '.join(map(str, missing[:5]))}"
                     f"{', ...' if len(missing) > 5 else ''}: no rollouts/val_step_N.jsonl gives the prompt count.")
    return notes


def render(run_dir: str | Path) -> list[Path]:
    """Write ``<run_dir>/plots/<figure>.png`` for each figure with data; returns the files written."""
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    return [save(fig, out_dir / f"{name}.png") for name, fig in figures(run_dir).items()]
