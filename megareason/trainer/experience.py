"""The typed record a training step passes from the driver to the model workers, and its packing.

A step's samples travel as right-padded [B, T] tensors (B samples, T the longest prompt + response)
plus each row's true length; a worker packs its share into micro-batches of at most
``trainer.micro_batch_tokens`` tokens (``models.packing``) and unpacks the outputs back to rows.

Alignment: column t of every per-token tensor scores token t given the tokens before it (as
``models.logprobs.logprob_head``); ``mask_BT`` is 1 on response tokens the model wrote: a multi-turn
episode's response also holds tool results, which are 0 (read as context, never trained on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from megareason.data.records import TokenizedPrompt
from megareason.models.packing import PackedMicroBatch, pack, pack_shared, plan_micro_batches, plan_shared, split_plan
from megareason.rollout.records import Completion


@dataclass
class Experience:
    """One step's samples. Optional fields are filled as the step goes (None until then)."""

    tokens_BT: torch.Tensor  # int64, prompt then response, right-padded with 0
    lengths_B: torch.Tensor  # int64, prompt + response tokens of each row
    mask_BT: torch.Tensor  # float32, 1 on response tokens
    rollout_logp_BT: torch.Tensor  # float32, the engine's log-probs of the sampled tokens (0 elsewhere)
    old_logp_BT: torch.Tensor | None = None  # the trainer's, before this step's updates
    ref_logp_BT: torch.Tensor | None = None  # the reference model's (KL)
    adv_BT: torch.Tensor | None = None
    values_BT: torch.Tensor | None = None  # critic (PPO): value of the state before token t
    returns_BT: torch.Tensor | None = None  # critic targets (PPO)

    def __len__(self) -> int:
        return self.tokens_BT.shape[0]

    def select(self, rows: Sequence[int] | slice) -> Experience:
        """The same record restricted to ``rows`` (and trimmed to their longest row)."""
        idx = (torch.arange(len(self))[rows] if isinstance(rows, slice)
               else torch.as_tensor(list(rows), dtype=torch.long))
        width = int(self.lengths_B[idx].max()) if len(idx) else 0
        return Experience(**{f.name: None if (v := getattr(self, f.name)) is None else
                             (v[idx] if v.dim() == 1 else v[idx, :width]) for f in fields(self)})

    def with_fields(self, **tensors: torch.Tensor) -> Experience:
        return replace(self, **tensors)


def build_experience(prompts: Sequence[TokenizedPrompt], groups: Sequence[Sequence[Completion]]) -> Experience:
    """Rows in (prompt, sample) order: prompt i's samples are rows i*n .. i*n + n - 1."""
    rows = [(p.token_ids, c) for p, group in zip(prompts, groups, strict=True) for c in group]
    width = max(len(ids) + len(c.token_ids) for ids, c in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    logp = torch.zeros(len(rows), width)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    for b, (ids, c) in enumerate(rows):
        p, r = len(ids), len(c.token_ids)
        tokens[b, :p] = torch.tensor(ids)
        tokens[b, p:p + r] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[b, p:p + r] = 1.0 if c.mask_T is None else torch.tensor(c.mask_T, dtype=torch.float32)
        if c.logprobs_T:
            logp[b, p:p + r] = torch.tensor(c.logprobs_T)
        lengths[b] = p + r
    return Experience(tokens_BT=tokens, lengths_B=lengths, mask_BT=mask, rollout_logp_BT=logp)


@dataclass
class MicroBatch(PackedMicroBatch):
    """A packed row of tokens with the per-token fields of its sequences laid out the same way
    ([1, W] each, keyed by Experience field name)."""

    fields: dict[str, torch.Tensor] | None = None


def prompt_lengths(mask_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """Tokens before each row's first response token (the whole row when it has none)."""
    has = mask_BT.bool().any(1)
    return torch.where(has, mask_BT.bool().int().argmax(1), lengths_B)


def pack_experience(exp: Experience, micro_batch_tokens: int, names: Sequence[str] = (),
                    share_prefix: bool = False, responses_only: bool = False,
                    width_multiple: int = 1, count: int = 0) -> list[MicroBatch]:
    """Pack ``exp``'s rows into micro-batches of at most ``micro_batch_tokens`` tokens, all of one
    width (a pipeline sends fixed-size activations), carrying the per-token fields ``names``.

    ``share_prefix``: rows with the same prompt (a GRPO group) go into one micro-batch where the model
    reads their prompt once (``models.packing.pack_shared``); the outputs are the same.
    ``responses_only``: outputs only where they score a response token (``keep_W``; 0 elsewhere), so
    the LM head skips the prompts. ``width_multiple``: the width the model runs on is a multiple of it
    (TP under sequence parallelism). ``count``: at least this many micro-batches (``packing.split_plan``:
    what the other ranks of an expert-parallel group run)."""
    lengths = exp.lengths_B.tolist()
    seqs = [exp.tokens_BT[b, :n] for b, n in enumerate(lengths)]
    prompt_lens = prompt_lengths(exp.mask_BT, exp.lengths_B).tolist()
    if share_prefix:
        units: dict[tuple, list[int]] = {}
        for b, p in enumerate(prompt_lens):
            units.setdefault((p, *seqs[b][:p].tolist()), []).append(b)
        # Heads at response positions only: the physical row is the micro-batch's cost (plan_shared).
        plan = plan_shared(lengths, list(units.values()), micro_batch_tokens,
                           prompt_lens if responses_only else None)
        plan = split_plan(plan, count, lambda unit: sum(lengths[b] for b in unit))
        batches = pack_shared(seqs, prompt_lens, plan, multiple=width_multiple)
    else:
        plan = split_plan(plan_micro_batches(lengths, micro_batch_tokens), count, lambda b: lengths[b])
        batches = pack(seqs, plan, multiple=width_multiple)
    out = []
    for mb in batches:
        packed = {}
        for name in names:
            x_BT = getattr(exp, name)
            row = x_BT.new_zeros(1, mb.tokens_BT.shape[1])
            row[0, : int(mb.cu_seqlens[-1])] = torch.cat([x_BT[b, :lengths[b]] for b in mb.index])
            packed[name] = row
        keep = None
        if responses_only:  # position t scores token t + 1: from the prompt's last token to the one before the end
            starts = mb.cu_seqlens.tolist()
            keep = torch.cat([torch.arange(a + max(prompt_lens[b], 1) - 1, a + lengths[b] - 1)
                              for a, b in zip(starts[:-1], mb.index, strict=True)])
            keep = keep if len(keep) else torch.zeros(1, dtype=torch.long)  # nothing to score: any one row
        out.append(MicroBatch(tokens_BT=mb.tokens_BT, cu_seqlens=mb.cu_seqlens, shared=mb.shared, keep_W=keep,
                              index=mb.index, fields=packed))
    return out


def unpack_to_rows(outputs_1W: Sequence[torch.Tensor], micro_batches: Sequence[MicroBatch],
                   lengths_B: torch.Tensor, width: int) -> torch.Tensor:
    """Per-micro-batch packed outputs [1, W] -> [B, width] rows in the caller's order (0 past a row's end)."""
    out = torch.zeros(len(lengths_B), width, dtype=outputs_1W[0].dtype)
    for x_1W, mb in zip(outputs_1W, micro_batches, strict=True):
        bounds = mb.cu_seqlens.tolist()
        for b, start, end in zip(mb.index, bounds[:-1], bounds[1:], strict=True):
            out[b, : end - start] = x_1W[0, start:end]
    return out
