"""Per-token log-probabilities and entropy from vocab-parallel logits, never gathering the vocab.

``vocab_parallel_logprobs`` is the fast path: each tensor-parallel rank holds a slice of the vocab; a
max, a sum of exponentials and the target logit are all-reduced (three [tokens]-sized messages), and
the backward pass is computed locally in closed form, as megatron-core's vocab-parallel cross entropy
does. ``reference_logprobs`` is the obvious version on full logits; tests check they agree.

``logprob_head`` adapts them to a model's output for ``models.schedule``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of the full softmax. logits [..., V], targets [...]."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, true_vocab, group):
        logits = logits.float()
        vocab_end = vocab_start + logits.shape[-1]
        if vocab_end > true_vocab:  # padded vocab entries do not exist: probability exactly 0
            logits = logits.clone()
            logits[..., max(true_vocab - vocab_start, 0):] = float("-inf")
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        log_z = sum_exp.log()  # of the shifted logits
        logp_local = shifted - log_z.unsqueeze(-1)
        probs = exp / sum_exp.unsqueeze(-1)

        in_range = (targets >= vocab_start) & (targets < vocab_end)
        local_idx = (targets - vocab_start).clamp(0, logits.shape[-1] - 1)
        target_logp = logp_local.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
        target_logp = torch.where(in_range, target_logp, torch.zeros_like(target_logp))
        dist.all_reduce(target_logp, group=group)

        plogp = torch.where(probs > 0, probs * logp_local, torch.zeros_like(probs)).sum(-1)
        dist.all_reduce(plogp, group=group)
        entropy = -plogp

        ctx.save_for_backward(probs, logp_local, entropy, local_idx, in_range)
        return target_logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        # d logp(t) / dz_j = 1[j = t] - p_j ;  dH / dz_j = -p_j (log p_j + H).  Every TP rank holds
        # the same upstream gradients, so each computes its own slice without communication.
        probs, logp_local, entropy, local_idx, in_range = ctx.saved_tensors
        safe_logp = torch.where(probs > 0, logp_local, torch.zeros_like(logp_local))
        grad = -probs * grad_logp.unsqueeze(-1)
        grad -= probs * (safe_logp + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        onehot = torch.zeros_like(probs).scatter_(-1, local_idx.unsqueeze(-1), 1.0) * in_range.unsqueeze(-1)
        grad += onehot * grad_logp.unsqueeze(-1)
        return grad, None, None, None, None


def vocab_parallel_logprobs(logits_local: torch.Tensor, targets: torch.Tensor, true_vocab: int,
                            group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy from this rank's vocab slice ``logits_local`` [..., V/tp].

    ``targets`` [...] are global token ids; vocab entries >= ``true_vocab`` (TP padding) are masked.
    Returns float32 tensors [...], identical on every rank of ``group`` (default: megatron's TP group).
    """
    from megatron.core import parallel_state as ps

    group = group or ps.get_tensor_model_parallel_group()
    vocab_start = dist.get_rank(group) * logits_local.shape[-1]
    return _VocabParallelLogprobs.apply(logits_local, targets, vocab_start, true_vocab, group)


def logprob_head(true_vocab: int, temperature: float = 1.0):
    """Turns the model's vocab-parallel logits [B, T, V/tp] for a micro-batch's tokens [B, T] into
    (``logp_BT``, ``entropy_BT``): column t scores token t given the tokens before it in its
    sequence. The first column of every sequence (column 0, or each packed sequence's start) is 0.

    ``temperature``: the logits are divided by it first, so the log-probs are those of the distribution
    the rollout engine sampled from (vLLM's processed log-probs); without it the importance ratio
    compares two different policies (SmolLM2 at 0.8: token_mult_prob_error 1.22 instead of ~1.0)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    def head(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = batch.tokens_BT
        keep = getattr(batch, "keep_W", None)
        if keep is not None:  # logits [1, n, V] at positions keep only; every other column is 0
            scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
            logp_n, entropy_n = vocab_parallel_logprobs(scaled, tokens[:, keep + 1], true_vocab)
            logp, entropy = (torch.zeros(tokens.shape, dtype=x.dtype, device=x.device).index_copy(1, keep + 1, x)
                             for x in (logp_n, entropy_n))
            return logp, entropy
        scaled = logits[:, :-1].float() if temperature == 1.0 else logits[:, :-1].float() / temperature
        logp, entropy = vocab_parallel_logprobs(scaled, tokens[:, 1:], true_vocab)
        pad = logp.new_zeros(logp.shape[0], 1)
        logp, entropy = torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1)
        if batch.cu_seqlens is not None:  # a packed sequence's first token is not predicted
            starts = torch.zeros_like(logp, dtype=torch.bool)
            starts[:, batch.cu_seqlens[:-1].long()] = True
            logp, entropy = logp.masked_fill(starts, 0.0), entropy.masked_fill(starts, 0.0)
        return logp, entropy

    return head
