"""How a RARO run's critic votes, step by step, from its ``rollouts/step_N_critic.jsonl`` dumps.

For each step: the share of judgements that name position A, B or Tie (whatever the order the answers
were shown in), the share naming the expert among the decided ones (``raro/critic_accuracy``), and the
share of judgement groups (the ``raro.critic_n`` judgements of one triplet, consecutive in the dump) whose
rewards differ: a group whose judgements all earn the same reward has zero group-relative advantage, so
it teaches the critic nothing.

    .venv/bin/python tools/raro_critic_votes.py outputs/compare_methods/tuning/raro --critic-n 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megareason.algorithms.raro import parse_label  # noqa: E402


def step_votes(path: Path, critic_n: int) -> dict[str, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups = [rows[i:i + critic_n] for i in range(0, len(rows), critic_n)]
    if any(len({r["critic_prompt"] for r in g}) != 1 or len(g) != critic_n for g in groups):
        raise SystemExit(f"{path}: rows do not come in groups of {critic_n} judgements of one prompt")
    labels = [parse_label(r["judgement"]) for r in rows]
    decided = [(lab, r["expert_shown_as"]) for lab, r in zip(labels, rows, strict=True) if lab in ("A", "B")]
    share = {lab: sum(x == lab for x in labels) / len(rows) for lab in ("A", "B", "tie")}
    return {**{f"says_{k}": v for k, v in share.items()},
            "accuracy": sum(lab == shown for lab, shown in decided) / max(len(decided), 1),
            "groups_with_signal": sum(len({r["critic_reward"] for r in g}) > 1 for g in groups) / len(groups)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (trainer.output_dir)")
    ap.add_argument("--critic-n", type=int, default=2, help="the run's raro.critic_n")
    a = ap.parse_args()
    for run in a.runs:
        print(f"{run}\n  step  says_A  says_B  says_tie  accuracy  groups_with_signal")
        for path in sorted((run / "rollouts").glob("step_*_critic.jsonl")):
            v = step_votes(path, a.critic_n)
            step = int(path.name.split("_")[1])
            print(f"  {step:4d}  {v['says_A']:6.2f}  {v['says_B']:6.2f}  {v['says_tie']:8.2f}  {v['accuracy']:8.2f}"
                  f"  {v['groups_with_signal']:18.2f}")


if __name__ == "__main__":
    main()
