"""``megareason report RUN_DIR``: the curves of a training run as PNG plots (from metrics.jsonl)."""

from __future__ import annotations

from pathlib import Path

from megareason.trainer.tracking import read_metrics

# One figure per panel; a panel draws every metric that starts with one of its prefixes.
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


def render(run_dir: str | Path) -> list[Path]:
    """Write ``<run_dir>/plots/<panel>.png`` for each panel with data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for panel, keys in PANELS.items():
        series = {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for k, points in series.items():
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=k)
        ax.set_xlabel("step")
        ax.set_title(f"{Path(run_dir).name}: {panel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{panel}.png"
        tmp = path.with_name(f".{path.name}.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(path)
        written.append(path)
    return written
