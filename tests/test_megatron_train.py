"""Training through megatron-core: gradients and one AdamW step, every TP x PP layout against
transformers + torch.optim.AdamW on the same weights, batch and loss (4 gloo processes)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from transformers import AutoModelForCausalLM

from megareason.models import weight_map
from megareason.models.arch import ModelArch

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
LR, EPS, CLIP = 1e-2, 1e-3, 0.5  # a large eps keeps Adam's first step smooth in the gradient


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (8, 12), generator=g)
    mask = torch.zeros(8, 12)
    for i in range(8):  # prompts of 3..5 tokens, responses of varying length, right padding
        mask[i, 3 + i % 3 : 12 - i % 4] = 1.0
    return tokens, mask


def nll_loss(logp_BT, entropy_BT, batch):
    """Token-mean NLL over the global batch: megatron-core divides by the summed count."""
    mask = batch.loss_mask_BT
    return -(logp_BT * mask).sum(), mask.sum(), {"entropy_sum": (entropy_BT * mask).sum()}


def _worker(model_dir: str, tokens, mask):

    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.packing import pack, plan_micro_batches
    from megareason.models.parallel import init_parallel
    from megareason.models.schedule import forward_backward
    from megareason.models.train import TrainBatch, wrap_for_training
    from megareason.settings import optimizer_settings

    out = {}
    for tp, pp in LAYOUTS:
        layout = init_parallel(tp, pp)
        ckpt = HFCheckpoint(model_dir)
        model = build_gpt(ckpt.arch)
        load_hf_weights(model, ckpt)
        ddp, opt = wrap_for_training(model, optimizer_settings(Config(optim=OptimConfig(eps=EPS, clip_grad=CLIP)), LR))
        # This DP rank's share of the global batch, as micro-batches of 2.
        share = tokens.shape[0] // layout.dp
        rows = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
        micro = [TrainBatch(t, m) for t, m in zip(tokens[rows].split(2), mask[rows].split(2), strict=True)]
        opt.zero_grad()
        # The same share packed two sequences to a row: the gradients must not change.
        plan = plan_micro_batches([tokens.shape[1]] * share, 2 * tokens.shape[1])
        packed = [TrainBatch(b.tokens_BT, torch.cat([mask[rows][i] for i in b.index])[None], b.cu_seqlens)
                  for b in pack(list(tokens[rows]), plan)]
        forward_backward(ddp, packed, logprob_head(ckpt.arch.vocab_size), nll_loss)
        packed_grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        sums = forward_backward(ddp, micro, logprob_head(ckpt.arch.vocab_size), nll_loss)
        grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        for n, g in grads.items():
            assert ((packed_grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-5, f"packed {n}"
        ok, grad_norm, _ = opt.step()
        params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        out[(tp, pp)] = dict(rank=(layout.tp_rank, layout.pp_rank), dp_rank=layout.dp_rank, grads=grads,
                             params=params, grad_norm=grad_norm, sums=sums, ok=ok)
    return out


def _merge(per_rank, layout, key, arch):
    tp, pp = layout
    shards = {}
    for results in per_rank:
        r = results[layout]
        if r["dp_rank"] == 0:
            shards[r["rank"]] = r[key]
    return weight_map.to_hf(shards, arch, tp, pp)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.slow
# Qwen2: QKV bias, untied embeddings; Qwen3: no biases, tied embeddings, per-head q/k norms (Llama's code
# paths and one more).
@pytest.mark.parametrize("family", ["tiny_qwen2", "tiny_qwen3"])
def test_gradients_and_adamw_step_match_transformers(family, request):
    model_dir = request.getfixturevalue(family)
    arch = ModelArch.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens, mask = _batch(arch.vocab_size)
    logp = torch.log_softmax(hf(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss = -(logp * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    named = dict(hf.named_parameters())
    ref_grads = {n: p.grad.clone() for n, p in named.items()}
    ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP).item()
    assert ref_norm > CLIP  # clipping is exercised
    torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS, weight_decay=0.0).step()

    per_rank = run_workers(4, _worker, str(model_dir), tokens, mask)
    baseline = _merge(per_rank, (1, 1), "grads", arch)
    for layout in LAYOUTS:
        grads = _merge(per_rank, layout, "grads", arch)
        params = _merge(per_rank, layout, "params", arch)
        assert set(grads) == {n for n in named if not (arch.tie_word_embeddings and n == "lm_head.weight")}
        for name, g in grads.items():
            assert _rel(g, baseline[name]) < 1e-5, f"{layout} {name}: grad vs TP=1,PP=1"
            assert _rel(g, ref_grads[name]) < 1e-4, f"{layout} {name}: grad vs transformers"
            assert (params[name] - named[name].detach()).abs().max().item() < 1e-5, f"{layout} {name}: AdamW step"
        for results in per_rank:
            r = results[layout]
            assert r["ok"] and abs(r["grad_norm"] - ref_norm) / ref_norm < 1e-5
            assert r["sums"]["count"] == mask.sum().item()
            assert abs(r["sums"]["loss_sum"] / r["sums"]["count"] - loss.item()) < 1e-5
