"""RARO (Relativistic Adversarial Reasoning Optimization): the critic's labels, the reward matrix
and the joint policy/critic loss weights, as pure functions.

One model plays two roles. As the **policy** it answers a question; as the **critic** it is shown the
question and two answers, the expert's and the policy's in random order, and says which one is the
expert's ("A" or "B") or "Tie". Positions are mapped back to roles with ``to_role``; the reward matrix
then pays each role:

    critic says     policy reward   critic reward
    expert          0               1
    policy          1               0
    tie             tau_pol         tau_crit
    (unparseable)   —               — (masked out of the loss)

Both roles are trained in one optimizer step on ``lambda_pol * J_pol + lambda_crit * J_crit``, each J
the usual (clipped, aggregated) GRPO objective of its own rows; ``role_advantage_scale`` folds the
weights into the advantages, which is exact because the clipped surrogate is positively homogeneous
in the advantage (``max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r))`` for w > 0, dual clip too).
"""

from __future__ import annotations

import re
from enum import StrEnum

import torch


class Verdict(StrEnum):
    """What the critic said, by role (after mapping positions back)."""

    EXPERT = "expert"
    POLICY = "policy"
    TIE = "tie"


# "Verdict: A", "**Verdict:** B", "verdict - tie", "\boxed{A}" ... The critic prompt asks for the first form.
# The letters are case-sensitive ("verdict: a tie" is not "A").
_LABEL = re.compile(r"(?i:verdict)\s*\**\s*[:\-]\s*\**\s*\(?(A|B|[Tt]ie|TIE)\b")
_BOXED = re.compile(r"\\boxed\{\s*(A|B|[Tt]ie|TIE)\s*\}")


def parse_label(text: str) -> str | None:
    """The critic's label, ``"A"``, ``"B"`` or ``"tie"``, read from the reply's last line that names one (as RARO's
    verl implementation reads it: the final verdict line, so a reply that first quotes the format, "answer with
    Verdict: A, B or Tie", still counts); None when no line does or that line names different labels (ambiguous).
    Repeating one label is fine."""
    for line in reversed(text.splitlines()):
        found = {"tie" if m.lower() == "tie" else m for m in _LABEL.findall(line) + _BOXED.findall(line)}
        if found:
            return found.pop() if len(found) == 1 else None
    return None


def to_role(label: str | None, expert_first: bool) -> Verdict | None:
    """Position label -> role: with the expert's answer shown as A (``expert_first``), "A" is Expert."""
    if label is None:
        return None
    if label == "tie":
        return Verdict.TIE
    if label not in ("A", "B"):
        raise ValueError(f"label must be 'A', 'B', 'tie' or None, got {label!r}")
    return Verdict.EXPERT if (label == "A") == expert_first else Verdict.POLICY


def reward_matrix(verdict: Verdict | None, *, tau_pol: float, tau_crit: float) -> tuple[float, float] | None:
    """(policy reward, critic reward) for one critic judgement; None for an unparseable one."""
    if verdict is None:
        return None
    return {Verdict.EXPERT: (0.0, 1.0), Verdict.POLICY: (1.0, 0.0), Verdict.TIE: (tau_pol, tau_crit)}[verdict]


def role_advantage_scale(is_critic_B: torch.Tensor, mask_BT: torch.Tensor, mode: str, *, lambda_pol: float,
                         lambda_crit: float) -> torch.Tensor:
    """Per-row factors w_B such that aggregating ``w_B * loss_BT`` over the whole batch gives
    ``lambda_pol * J(policy rows) + lambda_crit * J(critic rows)``, each J aggregated over its own
    rows alone in ``mode`` (see ``algorithms.losses.aggregate``): w = lambda_role * N / N_role, with N
    the batch's count (tokens for token-mean, scored rows otherwise) and N_role the role's. A role
    without scored rows gets weight 0 (it has no J)."""
    if is_critic_B.dtype != torch.bool or is_critic_B.dim() != 1 or len(is_critic_B) != mask_BT.shape[0]:
        raise ValueError(f"is_critic_B must be a bool [B] tensor matching mask_BT {tuple(mask_BT.shape)}")
    m_BT = mask_BT.bool()
    count_B = m_BT.sum(1).float() if mode == "token-mean" else (m_BT.sum(1) > 0).float()
    total = count_B.sum()
    n_crit, n_pol = count_B[is_critic_B].sum(), count_B[~is_critic_B].sum()
    w_pol = lambda_pol * total / n_pol if n_pol > 0 else total.new_zeros(())
    w_crit = lambda_crit * total / n_crit if n_crit > 0 else total.new_zeros(())
    return torch.where(is_critic_B, w_crit, w_pol)


def role_mini_batches(is_critic_B: torch.Tensor, mini_batches: int) -> list[torch.Tensor]:
    """Row indices of each of ``mini_batches`` optimizer steps, every one holding its share of both roles:
    the policy rows cut into ``mini_batches`` contiguous parts, the critic rows likewise, part m of each
    (policy rows first) in mini-batch m. With weights from ``role_advantage_scale`` on each part, every
    optimizer step's objective is ``lambda_pol * J_pol + lambda_crit * J_crit`` (RARO's joint objective), not only the
    step's sum. One mini-batch of policy-first rows: ``arange(B)``."""
    if is_critic_B.dtype != torch.bool or is_critic_B.dim() != 1 or mini_batches < 1:
        raise ValueError(f"need a bool [B] is_critic_B and mini_batches >= 1, got {is_critic_B.dtype} "
                         f"{tuple(is_critic_B.shape)}, {mini_batches}")
    pol, crit = (~is_critic_B).nonzero().flatten(), is_critic_B.nonzero().flatten()

    def part(rows: torch.Tensor, m: int) -> torch.Tensor:
        return rows[len(rows) * m // mini_batches:len(rows) * (m + 1) // mini_batches]

    return [torch.cat([part(pol, m), part(crit, m)]) for m in range(mini_batches)]
