"""The PPO critic: megatron-core trunk + value head against transformers' trunk + the same head,
values for every TP x PP layout and one AdamW step on a masked squared error (4 gloo processes)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from transformers import AutoModel

from megareason.models import weight_map
from megareason.models.arch import ModelArch

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
LR, EPS = 1e-2, 1e-3


def _data(vocab):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (4, 9), generator=g)
    targets = torch.randn(4, 9, generator=g)
    mask = (torch.arange(9) >= 3).float().expand(4, 9).clone()
    head_w, head_b = torch.randn(1, 128, generator=g) * 0.1, torch.tensor([0.3])
    return tokens, targets, mask, head_w, head_b


def value_loss(values_BT, batch):
    err = (values_BT - batch.targets_BT) ** 2 * batch.loss_mask_BT
    return err.sum(), batch.loss_mask_BT.sum(), {}


def _worker(model_dir, tokens, targets, mask, head_w, head_b, ckpt_root):
    from dataclasses import dataclass

    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Critic
    from megareason.settings import optimizer_settings

    @dataclass
    class ValueBatch:
        tokens_BT: torch.Tensor
        targets_BT: torch.Tensor
        loss_mask_BT: torch.Tensor
        cu_seqlens: torch.Tensor | None = None

    optim = optimizer_settings(Config(optim=OptimConfig(eps=EPS, clip_grad=0.0)), LR)
    out = {}
    for tp, pp in LAYOUTS:
        layout = init_parallel(tp, pp)
        critic = Critic(HFCheckpoint(model_dir), optim)
        if layout.last_stage:
            with torch.no_grad():
                critic.model.output_layer.weight.copy_(head_w)
                critic.model.output_layer.bias.copy_(head_b)
        values = critic.values(tokens, micro_batch_size=2)
        share = tokens.shape[0] // layout.dp
        rows = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
        result = critic.train_step([ValueBatch(tokens[rows], targets[rows], mask[rows])], value_loss)
        state = {n: p.detach().clone() for n, p in critic.model.named_parameters()}
        # A checkpoint round trip (value head included) into a fresh critic gives the same values.
        critic.save(f"{ckpt_root}/critic_{tp}_{pp}")
        fresh = Critic(HFCheckpoint(model_dir), optim)
        fresh.load(f"{ckpt_root}/critic_{tp}_{pp}")
        assert torch.equal(fresh.values(tokens, micro_batch_size=2), critic.values(tokens, micro_batch_size=2))
        out[(tp, pp)] = dict(values=values, loss=result.loss, state=state, dp=layout.dp_rank,
                             rank=(layout.tp_rank, layout.pp_rank))
    return out


@pytest.mark.slow
def test_critic_values_and_step_match_transformers(tiny_llama, tmp_path):
    arch = ModelArch.from_pretrained(tiny_llama)
    tokens, targets, mask, head_w, head_b = _data(arch.vocab_size)
    trunk = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32)
    head = torch.nn.Linear(arch.hidden_size, 1)
    with torch.no_grad():
        head.weight.copy_(head_w)
        head.bias.copy_(head_b)
    values = head(trunk(tokens).last_hidden_state)[..., 0]
    loss = ((values - targets) ** 2 * mask).sum() / mask.sum()
    loss.backward()
    torch.optim.AdamW([*trunk.parameters(), *head.parameters()], lr=LR, eps=EPS, weight_decay=0.0).step()
    expected = {f"model.{n}": p.detach() for n, p in trunk.named_parameters()}

    per_rank = run_workers(4, _worker, str(tiny_llama), tokens, targets, mask, head_w, head_b, str(tmp_path))
    for layout in LAYOUTS:
        shards = {}
        for results in per_rank:
            r = results[layout]
            assert (r["values"] - values.detach()).abs().max().item() < 1e-4, layout
            assert abs(r["loss"] - loss.item()) < 1e-5
            if r["dp"] == 0:
                shards[r["rank"]] = r["state"]
        merged = weight_map.to_hf(shards, arch, *layout, with_output=False)
        assert set(merged) == set(expected)
        for name, t in merged.items():
            assert (t - expected[name]).abs().max().item() < 1e-5, f"{layout} {name}"
        last = shards[(0, layout[1] - 1)]
        assert (last["output_layer.weight"] - head.weight.detach()).abs().max().item() < 1e-5
        assert (last["output_layer.bias"] - head.bias.detach()).abs().max().item() < 1e-5
