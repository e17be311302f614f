"""Prefix sharing: a GRPO group's prompt computed once. The layout by hand, then the model's outputs and
gradients with and without sharing (TP x PP in {1x1, 2x2} on 4 gloo processes)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

from megareason.models.packing import pack_shared, plan_shared
from megareason.trainer.experience import Experience, pack_experience


def _t(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_physical_row_positions_gather_and_mask_by_hand():
    # Unit 1: prompt [1 2 3] with responses [4 5] and [6]; unit 2: prompt [7 8] with response [9 9 9].
    seqs = [_t(1, 2, 3, 4, 5), _t(1, 2, 3, 6), _t(7, 8, 9, 9, 9)]
    (mb,) = pack_shared(seqs, [3, 3, 2], [[[0, 1], [2]]])
    s = mb.shared
    assert mb.tokens_BT.tolist() == [[1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 8, 9, 9, 9]]  # the usual packed row
    assert mb.cu_seqlens.tolist() == [0, 5, 9, 14] and mb.index == [0, 1, 2]
    assert s.tokens_1P.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9]]
    assert s.positions_1P.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]]
    assert s.gather_W.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]
    allowed = ~s.attention_mask()[0, 0]
    assert allowed[5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # "6" reads its prompt and itself
    assert allowed[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert allowed[8].nonzero().flatten().tolist() == [6, 7, 8]  # nothing of unit 1
    assert allowed[2].nonzero().flatten().tolist() == [0, 1, 2]


def test_padding_reads_nothing_and_rows_share_one_width():
    seqs = [_t(1, 2, 3), _t(1, 2, 4), _t(5, 6, 7, 8, 9, 10)]
    mbs = pack_shared(seqs, [2, 2, 1], [[[0, 1]], [[2]]])
    assert [m.shared.tokens_1P.shape[1] for m in mbs] == [6, 6]  # 2 + 1 + 1 padded to 6
    allowed = ~mbs[0].shared.attention_mask()[0, 0]
    assert allowed[4].nonzero().flatten().tolist() == [4] and allowed[5].nonzero().flatten().tolist() == [5]
    with pytest.raises(ValueError, match="do not share a prefix"):
        pack_shared([_t(1, 2, 3), _t(1, 9, 3)], [2, 2], [[[0, 1]]])


def test_plan_keeps_units_together_and_cuts_those_over_budget():
    lengths = [5, 5, 5, 5, 3, 3]
    plan = plan_shared(lengths, [[0, 1, 2, 3], [4, 5]], max_tokens=12)
    # unit 1 (20 tokens) is cut into [0, 1] and [2, 3] (10 each); unit 2 (6) goes where it fits first
    assert plan == [[[0, 1]], [[2, 3]], [[4, 5]]]
    plan = plan_shared(lengths, [[0, 1], [2, 3], [4, 5]], max_tokens=16)
    assert sorted(sorted(i for u in b for i in u) for b in plan) == [[0, 1, 4, 5], [2, 3]]
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        plan_shared([20], [[0]], max_tokens=12)


def test_a_physical_budget_keeps_a_group_whole_and_its_row_within_budget():
    lengths, prefix_lens = [5, 5, 5, 5, 3, 3], [3, 3, 3, 3, 1, 1]
    # Counted physically, unit 1 is 5 + 2 + 2 + 2 = 11 tokens: whole within 12 (unshared: 20, cut in two).
    assert plan_shared(lengths, [[0, 1, 2, 3], [4, 5]], 12, prefix_lens) == [[[0, 1, 2, 3]], [[4, 5]]]
    # Within 10 it is cut after 9 tokens ([0, 1, 2]); [3] (5) and unit 2 (3 + 2) share the second micro-batch.
    plan = plan_shared(lengths, [[0, 1, 2, 3], [4, 5]], 10, prefix_lens)
    assert plan == [[[0, 1, 2]], [[3], [4, 5]]]
    seqs = [torch.cat([_t(1, 2, 3), _t(4 + i, 9)]) for i in range(4)] + [_t(7, 8, 9), _t(7, 5, 6)]
    assert [m.shared.tokens_1P.shape[1] for m in pack_shared(seqs, prefix_lens, plan)] == [10, 10]


def _experience(vocab: int) -> Experience:
    """Two prompts (7 and 4 tokens) with three samples each, responses of varying length."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, vocab, (7,), generator=g), torch.randint(1, vocab, (4,), generator=g)]
    rows = [(p, torch.randint(1, vocab, (n,), generator=g)) for p in prompts for n in (5, 2, 8)]
    width = max(len(p) + len(r) for p, r in rows)
    tokens, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width)
    for b, (p, r) in enumerate(rows):
        tokens[b, : len(p) + len(r)] = torch.cat([p, r])
        mask[b, len(p) : len(p) + len(r)] = 1.0
    lengths = torch.tensor([len(p) + len(r) for p, r in rows])
    return Experience(tokens_BT=tokens, lengths_B=lengths, mask_BT=mask, rollout_logp_BT=torch.zeros(len(rows), width))


def _nll(logp_1W, entropy_1W, batch):
    mask = batch.fields["mask_BT"]
    return -(logp_1W * mask).sum(), mask.sum(), {"entropy_sum": (entropy_1W * mask).sum()}


# (share the prompt, LM head on response-scoring positions only)
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]


def _worker(model_dir: str, exp: Experience):
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.parallel import init_parallel
    from megareason.models.schedule import forward_backward, forward_outputs
    from megareason.models.train import wrap_for_training
    from megareason.settings import optimizer_settings
    from megareason.trainer.experience import unpack_to_rows

    out = {}
    for tp, pp in [(1, 1), (2, 2)]:
        init_parallel(tp, pp)
        ckpt = HFCheckpoint(model_dir)
        model = build_gpt(ckpt.arch)
        load_hf_weights(model, ckpt)
        ddp, _ = wrap_for_training(model, optimizer_settings(Config(), OptimConfig.lr))
        head = logprob_head(ckpt.arch.vocab_size)
        for share, responses_only in VARIANTS:
            micro = pack_experience(exp, 24, ["mask_BT"], share_prefix=share, responses_only=responses_only)
            outs = forward_outputs(model, micro, head, 2)
            width = exp.tokens_BT.shape[1]
            logp = unpack_to_rows([o[0] for o in outs], micro, exp.lengths_B, width)
            sums = forward_backward(ddp, micro, head, _nll)
            grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
            tokens = sum(m.shared.tokens_1P.numel() if share else m.tokens_BT.numel() for m in micro)
            out[(tp, pp, share, responses_only)] = dict(logp=logp, sums=sums, grads=grads, tokens=tokens)
    return out


@pytest.mark.slow
def test_shared_prefix_and_response_only_head_give_the_same_outputs_and_gradients(tiny_qwen2):
    from megareason.models.arch import ModelArch

    exp = _experience(ModelArch.from_pretrained(tiny_qwen2).vocab_size)
    m = exp.mask_BT.bool()
    for results in run_workers(4, _worker, str(tiny_qwen2), exp):
        for layout in [(1, 1), (2, 2)]:
            plain = results[layout + (False, False)]
            assert results[layout + (True, False)]["tokens"] < plain["tokens"]  # the model ran on fewer positions
            # Heads at responses only: the budget (24) counts physical tokens, so both groups stay whole
            # (7 + 5 + 2 + 8 = 22 and 4 + 5 + 2 + 8 = 19: two rows of 22) where the unshared count cuts each
            # in two (four rows of 15: [12, 9] read as 7 + 5 + 2, [15], [9, 6] as 11, [12]).
            assert (results[layout + (True, True)]["tokens"], results[layout + (True, False)]["tokens"]) == (44, 60)
            for variant in VARIANTS[1:]:
                other = results[layout + variant]
                assert (plain["logp"][m] - other["logp"][m]).abs().max().item() < 1e-5, variant
                if variant[1]:  # only response tokens are scored
                    assert other["logp"][~m].abs().max().item() == 0 and plain["logp"][~m].abs().max().item() > 0
                dp = 4 // (layout[0] * layout[1])  # every DP rank passed the whole batch; the sums add over DP
                assert plain["sums"]["count"] == other["sums"]["count"] == dp * exp.mask_BT.sum().item()
                assert abs(plain["sums"]["loss_sum"] / other["sums"]["loss_sum"] - 1) < 1e-5
                for name, g in plain["grads"].items():
                    rel = ((other["grads"][name] - g).norm() / g.norm().clamp_min(1e-12)).item()
                    assert rel < 1e-5, f"{layout} {variant} {name}: {rel}"
