"""megatron-core log-probs against transformers, for TP in {1, 2} x PP in {1, 2} on 4 gloo processes."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from transformers import AutoModelForCausalLM

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


LENGTHS = (5, 3, 7)  # packed into one row of 16 tokens: three sequences and one pad


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 10), generator=torch.Generator().manual_seed(0))


def _packed(vocab: int):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
    row = torch.cat([*seqs, torch.zeros(1, dtype=torch.long)])[None]
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    return seqs, row, cu


def _worker(model_dir: str, tokens: torch.Tensor, packed_row: torch.Tensor, cu: torch.Tensor):
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.logprobs import logprob_head
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor, Reference
    from megareason.models.schedule import TokenBatch, forward_outputs, padded_micro_batches
    from megareason.settings import optimizer_settings

    out = {}
    for tp, pp in LAYOUTS:
        init_parallel(tp, pp)
        ckpt = HFCheckpoint(model_dir)
        actor = Actor(ckpt, optimizer_settings(Config(), OptimConfig.lr))
        out[(tp, pp)] = actor.logprobs(tokens, micro_batch_size=2)
        hot = forward_outputs(actor.model, padded_micro_batches(tokens, 2), logprob_head(ckpt.arch.vocab_size, 0.5), 2)
        out[("temperature", tp, pp)] = torch.cat([o[0] for o in hot])
        out[("packed", tp, pp)] = actor.logprobs_of([TokenBatch(packed_row, cu), TokenBatch(packed_row, cu)])[1]
        reference = Reference(ckpt)
        before = reference.logprobs(tokens, micro_batch_size=2)
        assert torch.equal(before, out[(tp, pp)][0])  # the actor's weights, the same micro-batches
        reference.offload()
        reference.onload()  # a round trip through CPU memory changes nothing
        assert torch.equal(reference.logprobs(tokens, micro_batch_size=2), before)
        # Other micro-batches change the kernels' blocking, hence the last bits on some CPUs (AVX2 builds).
        assert (reference.logprobs(tokens, micro_batch_size=4) - before).abs().max().item() < 1e-5
        assert not any(p.requires_grad for p in reference.model.parameters())
    return out


@pytest.mark.slow
# Qwen2: QKV bias, untied embeddings; Qwen3: no biases, tied embeddings over PP, per-head q/k norms (Llama's
# code paths and one more).
@pytest.mark.parametrize("family", ["tiny_qwen2", "tiny_qwen3"])
def test_logprobs_match_transformers_for_every_layout(family, request):
    model_dir = request.getfixturevalue(family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        logits = hf(tokens).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, -1)
    expected_logp = logp_all.gather(-1, tokens[:, 1:, None])[..., 0]
    # At a sampling temperature the log-probs are those of softmax(logits / T), as vLLM reports them.
    expected_hot = torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert (expected_hot - expected_logp).abs().max() > 1e-2
    expected_entropy = -(logp_all.exp() * logp_all).sum(-1)

    seqs, packed_row, cu = _packed(hf.config.vocab_size)
    with torch.no_grad():
        expected_packed = [torch.log_softmax(hf(s[None]).logits[0, :-1], -1).gather(-1, s[1:, None])[:, 0]
                           for s in seqs]

    per_rank = run_workers(4, _worker, str(model_dir), tokens, packed_row, cu)
    for rank, results in enumerate(per_rank):
        for layout in LAYOUTS:
            logp, _ = results[("packed",) + layout]
            for start, seq, want in zip(cu.tolist()[:-1], seqs, expected_packed, strict=True):
                got = logp[0, start : start + len(seq)]
                assert got[0] == 0 and (got[1:] - want).abs().max().item() < 1e-4, f"packed {layout}"
        for layout in LAYOUTS:
            logp, entropy = results[layout]
            assert logp.shape == tokens.shape and (logp[:, 0] == 0).all()
            err = (logp[:, 1:] - expected_logp).abs().max().item()
            assert err < 1e-4, f"rank {rank} TP,PP={layout}: max |dlogp| {err}"
            assert (entropy[:, 1:] - expected_entropy).abs().max().item() < 1e-4
            hot = results[("temperature",) + layout]
            assert (hot[:, 1:] - expected_hot).abs().max().item() < 1e-4, f"temperature, TP,PP={layout}"
