"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv
2503.14476): overlong reward shaping, dynamic sampling's group filter, and masking truncated responses.

Pure functions; ``dynamic_sampling`` takes the trainer's ``draw`` (one rollout batch per call) and only
decides which rows to keep and when to stop. DAPO's other two parts already exist: clip-higher is
``ppo_policy_loss``'s ``clip_high`` and the token-level loss is ``aggregate``'s "token-mean".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

BatchT = TypeVar("BatchT")


def overlong_penalty(length_B: torch.Tensor, *, max_tokens: int, buffer: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (the paper's Eq. 13), to add to each response's reward. float [B].

    ``length_B``: response lengths in tokens. With ``L_cache = buffer`` and ``L_max = max_tokens``:
    0 for ``length <= max_tokens - buffer``; ``-penalty_factor * (length - (max_tokens - buffer)) / buffer``
    over the last ``buffer`` tokens, reaching ``-penalty_factor`` at ``max_tokens``; ``-penalty_factor``
    beyond it (as OpenRLHF caps it; verl's formula is the same up to ``max_tokens``, which it never exceeds).
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"need 0 < buffer <= max_tokens, got buffer={buffer}, max_tokens={max_tokens}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    if length_B.dim() != 1:
        raise ValueError(f"length_B must be 1-D, got shape {tuple(length_B.shape)}")
    exceed_B = length_B.to(torch.get_default_dtype()) - (max_tokens - buffer)
    return -penalty_factor * (exceed_B / buffer).clamp(0, 1)


def select_informative(reward_B: torch.Tensor, group_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic sampling's filter: the groups whose rewards are not all equal, and their rows.

    ``reward_B``: float [B], the value DAPO filters on (its accuracy or its score: verl's
    ``filter_groups.metric``). ``group_B``: integer [B] group ids, in any order. Returns
    (``keep_groups_G``: the informative group ids, ascending; ``keep_B``: bool [B], rows of those groups).
    A group is informative when its largest and smallest rewards differ (DAPO: std > 0; the exact test
    keeps float rounding from passing seven rewards of 0.7 as informative). A group of one sample is
    dropped: its GRPO and REINFORCE++-baseline advantages are 0 (verl keeps such groups).
    """
    if reward_B.dim() != 1 or group_B.shape != reward_B.shape:
        raise ValueError(f"expected reward_B and group_B of one 1-D shape, got {tuple(reward_B.shape)} and "
                         f"{tuple(group_B.shape)}")
    if group_B.is_floating_point() or group_B.dtype == torch.bool:
        raise ValueError(f"group_B must hold integer group ids, got {group_B.dtype}")
    ids_G, group_of_B = torch.unique(group_B, return_inverse=True)
    r_B = reward_B.double()
    max_G = r_B.new_empty(len(ids_G)).scatter_reduce_(0, group_of_B, r_B, "amax", include_self=False)
    min_G = r_B.new_empty(len(ids_G)).scatter_reduce_(0, group_of_B, r_B, "amin", include_self=False)
    informative_G = max_G > min_G
    return ids_G[informative_G], informative_G[group_of_B]


@dataclass(frozen=True)
class DynamicSample(Generic[BatchT]):
    """What ``dynamic_sampling`` drew.

    ``batches``: every drawn batch, in order, with ``keep_B`` (bool [B]): the rows to train on (rows of
    informative groups, surplus groups of the last batch dropped; all False for a batch with none).
    ``groups``: informative groups kept, at most ``want``. ``drawn_groups``: groups drawn in all.
    ``tries``: batches drawn. ``enough``: ``groups == want`` (False: ``max_tries`` ran out first).
    """

    batches: list[tuple[BatchT, torch.Tensor]]
    groups: int
    drawn_groups: int
    tries: int
    enough: bool


def dynamic_sampling(draw: Callable[[], tuple[BatchT, torch.Tensor, torch.Tensor]], *, want: int,
                     max_tries: int) -> DynamicSample[BatchT]:
    """DAPO's dynamic sampling: call ``draw()`` until ``want`` informative groups are kept or ``max_tries``
    batches are drawn, whichever comes first (verl's ``max_num_gen_batches``; it raises when they run out,
    here the caller gets ``enough=False`` and proceeds with what it has).

    ``draw()`` returns ``(batch, reward_B, group_B)``: the trainer's own rollout record, its rewards and
    group ids (ids are per batch). Informative groups are ``select_informative``'s; from the batch that
    reaches ``want``, the groups with the smallest ids are kept and the surplus dropped (DAPO aligns the
    batch to its train size the same way).
    """
    if want < 1 or max_tries < 1:
        raise ValueError(f"need want >= 1 and max_tries >= 1, got want={want}, max_tries={max_tries}")
    batches: list[tuple[BatchT, torch.Tensor]] = []
    groups = drawn_groups = 0
    while groups < want and len(batches) < max_tries:
        batch, reward_B, group_B = draw()
        keep_groups_G, keep_B = select_informative(reward_B, group_B)
        drawn_groups += len(torch.unique(group_B))
        keep_groups_G = keep_groups_G[: want - groups]
        keep_B = keep_B & torch.isin(group_B, keep_groups_G)
        groups += len(keep_groups_G)
        batches.append((batch, keep_B))
    return DynamicSample(batches, groups, drawn_groups, len(batches), groups == want)


def mask_truncated(mask_BT: torch.Tensor, truncated_B: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: ``mask_BT`` with the rows of truncated responses (``truncated_B``: bool
    [B], e.g. vLLM's finish_reason "length") zeroed, so they leave the loss. Same dtype as ``mask_BT``."""
    if truncated_B.dtype != torch.bool or truncated_B.dim() != 1 or mask_BT.dim() != 2 \
            or len(truncated_B) != mask_BT.shape[0]:
        raise ValueError(f"expected mask_BT [B, T] and a bool truncated_B [B], got {tuple(mask_BT.shape)} and "
                         f"{truncated_B.dtype} {tuple(truncated_B.shape)}")
    return torch.where(truncated_B[:, None], torch.zeros_like(mask_BT), mask_BT)
