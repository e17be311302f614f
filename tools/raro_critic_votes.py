"""How a RARO run's critic votes, step by step, from its ``rollouts/step_N_critic.jsonl`` dumps.

For each step: the share of judgements that name position A, B or Tie (whatever the order the answers
were shown in), the share naming the expert among the decided ones (``raro/critic_accuracy``), and the
share of judgement groups (the ``raro.critic_n`` judgements of one triplet, consecutive in the dump) whose
rewards differ: a group whose judgements all earn the same reward has zero group-relative advantage, so
it teaches the critic nothing; and the mean group-relative advantage of the Tie judgements (GRPO's, as
the run's update computes it from these rewards): above 0, the step's update makes a Tie likelier. And,
from ``rollouts/step_N.jsonl``, what the policy's reward says about its own answers: the mean reward of
its correct answers minus that of its wrong ones (the task's verifier only monitors them in RARO). A
verifier's reward separates them by ~1; a reward that cannot tell them apart (gap ~0) gives the policy
nothing to learn correctness from. Runs without a critic (GRPO) show the gap alone, for comparison.

    .venv/bin/python tools/raro_critic_votes.py outputs/compare_methods/raro outputs/compare_methods/grpo
    .venv/bin/python tools/raro_critic_votes.py --critic-n 4 outputs/compare_methods/raro_fair
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megareason.algorithms.advantages import grpo_advantages  # noqa: E402
from megareason.algorithms.raro import parse_label  # noqa: E402


def step_votes(path: Path, critic_n: int, mode: str = "std") -> dict[str, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups = [rows[i:i + critic_n] for i in range(0, len(rows), critic_n)]
    if any(len({r["critic_prompt"] for r in g}) != 1 or len(g) != critic_n for g in groups):
        raise SystemExit(f"{path}: rows do not come in groups of {critic_n} judgements of one prompt")
    labels = [parse_label(r["judgement"]) for r in rows]
    decided = [(lab, r["expert_shown_as"]) for lab, r in zip(labels, rows, strict=True) if lab in ("A", "B")]
    share = {lab: sum(x == lab for x in labels) / len(rows) for lab in ("A", "B", "tie")}
    adv = grpo_advantages(torch.tensor([float(r["critic_reward"]) for r in rows]),
                          torch.arange(len(rows)) // critic_n, mode=mode)
    ties = [a for a, lab in zip(adv.tolist(), labels, strict=True) if lab == "tie"]
    return {**{f"says_{k}": v for k, v in share.items()},
            "accuracy": sum(lab == shown for lab, shown in decided) / max(len(decided), 1),
            "groups_with_signal": sum(len({r["critic_reward"] for r in g}) > 1 for g in groups) / len(groups),
            "tie_advantage": sum(ties) / len(ties) if ties else float("nan")}


def policy_reward_gap(*paths: Path) -> dict[str, float]:
    """The policy's answers in these dumps (one step's, or every step's pooled): how many, how many correct,
    and the mean reward of the correct ones minus that of the wrong ones (nan when either set is empty;
    masked answers, reward None, left out)."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    scored = [r for r in rows if r["reward"] is not None]
    right = [r["reward"] for r in scored if r["correct"]]
    wrong = [r["reward"] for r in scored if not r["correct"]]
    gap = sum(right) / len(right) - sum(wrong) / len(wrong) if right and wrong else float("nan")
    return {"answers": len(scored), "correct": len(right), "reward_gap": gap}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (trainer.output_dir)")
    ap.add_argument("--critic-n", type=int, default=2, help="the run's raro.critic_n")
    ap.add_argument("--grpo-mode", default="std", help="the run's algorithm.grpo_mode")
    a = ap.parse_args()
    for run in a.runs:
        print(f"{run}\n  step  answers  correct  reward_gap  says_A  says_B  says_tie  accuracy  groups_with_signal"
              "  tie_advantage")
        dumps = [p for p in sorted((run / "rollouts").glob("step_*.jsonl")) if not p.name.endswith("_critic.jsonl")]
        for path in dumps:
            step = int(path.stem.split("_")[1])
            g = policy_reward_gap(path)
            line = f"  {step:4d}  {g['answers']:7d}  {g['correct']:7d}  {g['reward_gap']:+10.3f}"
            critic = path.with_name(f"{path.stem}_critic.jsonl")
            if critic.is_file():
                v = step_votes(critic, a.critic_n, a.grpo_mode)
                line += (f"  {v['says_A']:6.2f}  {v['says_B']:6.2f}  {v['says_tie']:8.2f}  {v['accuracy']:8.2f}"
                         f"  {v['groups_with_signal']:18.2f}  {v['tie_advantage']:+13.3f}")
            print(line)
        if dumps:
            g = policy_reward_gap(*dumps)
            print(f"  all   {g['answers']:7d}  {g['correct']:7d}  {g['reward_gap']:+10.3f}  (all steps pooled)")


if __name__ == "__main__":
    main()
