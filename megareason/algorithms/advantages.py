"""Advantage estimators: group-normalised outcome advantages (GRPO family), REINFORCE++-baseline, GAE,
whitening.

Pure tensor functions. ``B`` is the number of samples (one response each), ``T`` the padded token
length; ``mask_BT`` is 1 (or True) on response tokens that are scored and 0 on prompt and padding.
Advantages are training targets: pass detached tensors (nothing here is meant to be differentiated).
"""

from __future__ import annotations

import torch

from megareason.algorithms.kl import kl_in_reward

GRPO_MODES = ("std", "no_std", "loo")


def _same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def grpo_advantages(reward_B: torch.Tensor, group_B: torch.Tensor, *, mode: str = "std",
                    eps: float = 1e-6) -> torch.Tensor:
    """Outcome advantage of each sample relative to the other samples of its prompt group.

    ``reward_B``: float [B]. ``group_B``: integer [B], the prompt group of each sample; groups may be
    any integers and their samples need not be contiguous. Returns float [B]:

    - ``"std"`` (GRPO): ``(r - mean_g) / (std_g + eps)`` with the *unbiased* (n - 1) standard deviation,
      torch.std's default, as verl and DeepSeek's GRPO use.
    - ``"no_std"`` (Dr. GRPO): ``r - mean_g``.
    - ``"loo"`` (RLOO): ``r_i - mean_{j != i} r_j`` = ``n / (n - 1) * (r_i - mean_g)``.

    A group whose rewards are all equal gets exactly 0 in every mode; this includes a group of one
    sample, which has no baseline (verl's "std" would give it ``r`` instead). Without that test, float
    rounding in the mean of e.g. seven rewards of 0.7 would leave ~1e-8 / (0 + eps) ~ 0.05 behind.
    """
    if mode not in GRPO_MODES:
        raise ValueError(f"unknown GRPO mode {mode!r}; expected one of {', '.join(GRPO_MODES)}")
    if reward_B.dim() != 1:
        raise ValueError(f"reward_B must be 1-D, got shape {tuple(reward_B.shape)}")
    _same_shape(reward_B=reward_B, group_B=group_B)
    if group_B.is_floating_point() or group_B.dtype == torch.bool:
        raise ValueError(f"group_B must hold integer group ids, got {group_B.dtype}")
    r_B = reward_B if reward_B.is_floating_point() else reward_B.float()
    _, group_of_B, n_G = torch.unique(group_B, return_inverse=True, return_counts=True)
    n_G = n_G.to(r_B.dtype)
    max_G = r_B.new_empty(len(n_G)).scatter_reduce_(0, group_of_B, r_B, "amax", include_self=False)
    min_G = r_B.new_empty(len(n_G)).scatter_reduce_(0, group_of_B, r_B, "amin", include_self=False)
    sum_G = r_B.new_zeros(len(n_G)).index_add_(0, group_of_B, r_B)
    centred_B = r_B - (sum_G / n_G)[group_of_B]
    n_B = n_G[group_of_B]
    if mode == "no_std":
        adv_B = centred_B
    elif mode == "loo":
        adv_B = centred_B * n_B / (n_B - 1).clamp(min=1)
    else:
        sq_G = r_B.new_zeros(len(n_G)).index_add_(0, group_of_B, centred_B.square())
        std_G = (sq_G / (n_G - 1).clamp(min=1)).sqrt()
        adv_B = centred_B / (std_G[group_of_B] + eps)
    return torch.where((max_G == min_G)[group_of_B], torch.zeros_like(adv_B), adv_B)


def broadcast_to_tokens(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] outcome advantages -> [B, T]: each sample's advantage on its response tokens, 0 elsewhere."""
    if adv_B.dim() != 1 or mask_BT.dim() != 2 or mask_BT.shape[0] != adv_B.shape[0]:
        raise ValueError(f"expected adv_B [B] and mask_BT [B, T], got {tuple(adv_B.shape)} and {tuple(mask_BT.shape)}")
    return torch.where(mask_BT.bool(), adv_B[:, None], torch.zeros((), dtype=adv_B.dtype, device=adv_B.device))


def gae(reward_BT: torch.Tensor, value_BT: torch.Tensor, mask_BT: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's response tokens. Returns (adv_BT, returns_BT).

    The steps of a row are its mask-1 tokens in order; mask-0 tokens (prompt, padding, and any holes
    such as tool output) are skipped entirely, so their rewards and values are ignored (put the
    outcome reward on the last response token). After a row's last response token the bootstrap value
    is 0. With ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``.
    ``adv_BT`` and ``returns_BT = adv_BT + value_BT`` are 0 where the mask is 0.
    Vectorised over B (one pass backwards over T); ``gae_reference`` is the per-row loop it must match.
    """
    _same_shape(reward_BT=reward_BT, value_BT=value_BT, mask_BT=mask_BT)
    if reward_BT.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got shape {tuple(reward_BT.shape)}")
    m_BT = mask_BT.bool()
    dtype = torch.promote_types(reward_BT.dtype, value_BT.dtype)
    r_BT, v_BT = reward_BT.to(dtype), value_BT.to(dtype)
    next_value_B = r_BT.new_zeros(r_BT.shape[0])  # V of the next response token, 0 past the last one
    next_adv_B = r_BT.new_zeros(r_BT.shape[0])
    zero = r_BT.new_zeros(())
    adv_T = []
    for t in reversed(range(r_BT.shape[1])):
        m_B = m_BT[:, t]
        adv_B = r_BT[:, t] + gamma * next_value_B - v_BT[:, t] + gamma * lam * next_adv_B
        next_adv_B = torch.where(m_B, adv_B, next_adv_B)
        next_value_B = torch.where(m_B, v_BT[:, t], next_value_B)
        adv_T.append(torch.where(m_B, adv_B, zero))
    adv_BT = torch.stack(adv_T[::-1], dim=1) if adv_T else r_BT.clone()
    return adv_BT, torch.where(m_BT, adv_BT + v_BT, zero)


def gae_reference(reward_BT: torch.Tensor, value_BT: torch.Tensor, mask_BT: torch.Tensor, *, gamma: float,
                  lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow, obviously-correct ``gae``: a Python loop over each row's response-token positions."""
    adv_BT = torch.zeros(reward_BT.shape, dtype=torch.float64)
    returns_BT = torch.zeros(reward_BT.shape, dtype=torch.float64)
    for b in range(reward_BT.shape[0]):
        steps = [t for t in range(reward_BT.shape[1]) if mask_BT[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(steps):
            r, v = float(reward_BT[b, t]), float(value_BT[b, t])
            next_adv = r + gamma * next_value - v + gamma * lam * next_adv
            next_value = v
            adv_BT[b, t], returns_BT[b, t] = next_adv, next_adv + v
    dtype = torch.promote_types(reward_BT.dtype, value_BT.dtype)
    return adv_BT.to(dtype), returns_BT.to(dtype)


def whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """PPO advantage whitening: ``(x - mean) / sqrt(var + eps)`` over the masked tokens of the whole batch.

    Mean and unbiased (n - 1) variance are taken over all mask-1 entries together (not per row), as
    verl's and TRL's ``masked_whiten``. Mask-0 entries come back as 0. Fewer than two masked tokens
    leave nothing to scale: the output is then 0 everywhere.
    """
    _same_shape(x_BT=x_BT, mask_BT=mask_BT)
    m = mask_BT.bool()
    zero = x_BT.new_zeros(())
    n = m.sum().to(x_BT.dtype)
    mean = torch.where(m, x_BT, zero).sum() / n.clamp(min=1)
    centred = torch.where(m, x_BT - mean, zero)
    var = centred.square().sum() / (n - 1).clamp(min=1)
    return centred * torch.rsqrt(var + eps)


def explained_variance(value_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """The critic's explained variance over the masked tokens: ``1 - Var(returns - value) / Var(returns)``.

    1 is a perfect critic, 0 one no better than a constant (any constant: the variance ignores the
    mean), negative one worse than a constant. NaN when the returns do not vary (nothing to explain).
    Population variances over all mask-1 entries of the batch together, as in stable-baselines3/verl.
    """
    _same_shape(value_BT=value_BT, returns_BT=returns_BT, mask_BT=mask_BT)
    m = mask_BT.bool()
    v, r = value_BT[m].double(), returns_BT[m].double()
    var_r = r.var(unbiased=False) if r.numel() else r.new_zeros(())
    if var_r == 0:
        return float("nan")
    return float(1 - (r - v).var(unbiased=False) / var_r)


def reinforce_pp_baseline_advantages(reward_B: torch.Tensor, group_B: torch.Tensor, mask_BT: torch.Tensor, *,
                                     kl_BT: torch.Tensor | None = None, kl_coef: float = 0.0,
                                     eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262; OpenRLHF's ``reinforce_baseline``): adv [B, T].

    ``reward_B``, ``group_B`` as ``grpo_advantages`` takes them; ``kl_BT``: the per-token KL estimate of
    the sampled tokens (``kl.kl_penalty``, detached; any values on mask-0 entries), None for no penalty.
    In OpenRLHF's order:

    1. group-mean baseline on the outcome reward: ``c_i = r_i - mean_g`` (``grpo_advantages`` "no_std";
       a group of one sample gets 0, as in OpenRLHF);
    2. token rewards: ``c_i`` on the row's last response token and ``-kl_coef * kl_t`` on every response
       token (``kl.kl_in_reward``): the KL enters *after* the baseline, so it is not centred by it;
    3. returns with gamma = 1 (OpenRLHF forces it): each response token's reward-to-go,
       ``A_t = c_i - kl_coef * sum(kl_s for the row's response tokens s >= t)``, the advantage;
    4. ``whiten`` over all response tokens of the batch together.

    Mask-0 entries are 0. ``whiten`` uses the unbiased variance and ``rsqrt(var + eps)`` (as verl's
    masked_whiten); OpenRLHF divides by n and clamps the variance at 1e-8 instead, a factor
    sqrt(n / (n - 1)) in scale over n tokens. (verl's own REINFORCE++-baseline differs in step 2: it sums
    the KL-in-reward into the sequence score before the baseline and broadcasts the result uniformly.)
    """
    if mask_BT.dim() != 2 or mask_BT.shape[0] != reward_B.shape[0]:
        raise ValueError(f"expected reward_B [B] and mask_BT [B, T], got {tuple(reward_B.shape)} and "
                         f"{tuple(mask_BT.shape)}")
    centred_B = grpo_advantages(reward_B, group_B, mode="no_std")
    adv_BT = broadcast_to_tokens(centred_B, mask_BT)
    if kl_BT is not None and kl_coef != 0:
        kl_reward_BT = kl_in_reward(torch.zeros_like(kl_BT), kl_BT, mask_BT, kl_coef)  # 0 off the mask
        to_go_BT = kl_reward_BT.flip(1).cumsum(1).flip(1)
        adv_BT = torch.where(mask_BT.bool(), adv_BT + to_go_BT, adv_BT)
    return whiten(adv_BT, mask_BT, eps)
