"""Rewards of the controlled experiment's control arms (``tools/controlled_experiment.py``), as reward files
for ``reward.by_source`` (verl's signature, ``docs/rewards.md``).

``random_matched``: 1 with probability ``extra_info["random_rate"]`` (the share of correct training samples
of the correctness-GRPO run it is matched to), 0 otherwise, whatever the response says: a reward as
frequent as the correctness reward that carries no information about correctness. The draw is a hash of
(``extra_info["random_seed"]``, the gold answer, the response), so a rerun or a resumed run draws the same
rewards and two identical responses to one question get one reward, as they do under the correctness reward
(a group of identical samples then carries no advantage under either). ``acc`` is the arithmetic reward's
correctness, so accuracy metrics and the held-out scores stay what they measure.

The format-only arm needs no file: the arithmetic reward's ``reward_type=boxed`` pays a final answer it can
read, right or wrong (``megareason/rewards/arithmetic.py``).
"""

from __future__ import annotations

import hashlib

from megareason.rewards.arithmetic import final_answer, parse_number


def uniform(seed: object, ground_truth: str, response: str) -> float:
    """A number in [0, 1) fixed by its arguments (the first 8 bytes of a SHA-256)."""
    digest = hashlib.sha256(f"{seed}\0{ground_truth}\0{response}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def random_matched(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    extra = extra_info or {}
    if "random_rate" not in extra:
        raise ValueError("random_matched needs extra_info.random_rate (the matched correctness rate, 0 to 1)")
    rate = float(extra["random_rate"])
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"extra_info.random_rate must be within [0, 1], got {rate}")
    answer = final_answer(solution_str)
    correct = answer is not None and parse_number(answer) == parse_number(ground_truth)
    return {"score": float(uniform(extra.get("random_seed", 0), ground_truth, solution_str) < rate), "acc": correct}
