"""LoRA on tensor-parallel linears: TP=2 gives TP=1's outputs and gradients; merged = base + scale·BA."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

from megareason.config.schema import Config, LoRAConfig, TrainerConfig
from megareason.models.lora import LoRALinear
from megareason.settings import lora_settings

IN, OUT, R = 16, 12, 4
SETTINGS = lora_settings(Config(lora=LoRAConfig(enabled=True, rank=R, alpha=8.0), trainer=TrainerConfig(seed=3)))


def _layer_worker(kind: str, tp: int, w_full, b_full, x, g):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megareason.models.parallel import init_parallel

    layout = init_parallel(tp, 1)
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=torch.float32, use_cpu_initialization=True)
    r, init = layout.tp_rank, torch.nn.init.zeros_
    if kind == "column":
        base = ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, bias=False, gather_output=False)
        base.weight.data.copy_(w_full.chunk(tp, 0)[r])
    else:
        base = RowParallelLinear(IN, OUT, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                 skip_bias_add=True)
        base.weight.data.copy_(w_full.chunk(tp, 1)[r])
    lora = LoRALinear(base, kind, "decoder.layers.0.mlp.linear_fc1", SETTINGS, r, tp)
    with torch.no_grad():  # a nonzero B, split like the layer's own split of B
        lora.lora_B.copy_(b_full.chunk(tp, 0)[r] if kind == "column" else b_full)
    x_in = (x.chunk(tp, -1)[r] if kind == "row" else x).clone().requires_grad_(True)
    out, _ = lora(x_in)
    g_local = g.chunk(tp, -1)[r] if kind == "column" else g
    (out * g_local).sum().backward()
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    return {"out": out.detach(), "dA": lora.lora_A.grad, "dB": lora.lora_B.grad, "dx": x_in.grad,
            "A": lora.lora_A.detach().clone(), "merged": lora.merged_weight(), "trainable": trainable,
            "W": base.weight.detach().clone()}


@pytest.mark.parametrize("kind", ["column", "row"])
def test_lora_at_tp2_matches_tp1(kind):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(OUT, IN, generator=gen), torch.randn(OUT, R, generator=gen)
    x, g = torch.randn(5, 2, IN, generator=gen), torch.randn(5, 2, OUT, generator=gen)
    [one] = run_workers(1, _layer_worker, kind, 1, w, b, x, g)
    two = run_workers(2, _layer_worker, kind, 2, w, b, x, g)
    split_out = -1 if kind == "column" else None  # column outputs are split; row outputs are whole
    cat = lambda key, dim: torch.cat([t[key] for t in two], dim)  # noqa: E731
    out2 = cat("out", -1) if split_out else two[0]["out"]
    # the reference by hand: x W^T + scale * x A^T B^T
    expected = x @ w.T + SETTINGS.scale * (x @ one["A"].T) @ b.T
    torch.testing.assert_close(one["out"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2, one["out"], rtol=1e-5, atol=1e-5)
    a2 = two[0]["A"] if kind == "column" else cat("A", 1)  # the same adapter at every layout
    torch.testing.assert_close(a2, one["A"], rtol=0, atol=0)
    if kind == "column":
        da2, db2, dx2 = two[0]["dA"], cat("dB", 0), two[0]["dx"]
        torch.testing.assert_close(two[1]["dA"], da2)  # the replicated A: the same gradient on every rank
    else:
        da2, db2, dx2 = cat("dA", 1), two[0]["dB"], cat("dx", -1)
        torch.testing.assert_close(two[1]["dB"], db2)
    for got, want in [(da2, one["dA"]), (db2, one["dB"]), (dx2, one["dx"])]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the base weight is frozen: only the adapter trains
    assert one["trainable"] == ["lora_A", "lora_B"]
    # merged weights = base + scale * B A, per rank shard and whole
    torch.testing.assert_close(one["merged"], w + SETTINGS.scale * b @ one["A"], rtol=1e-6, atol=1e-6)
    merged2 = cat("merged", 0 if kind == "column" else 1)
    torch.testing.assert_close(merged2, one["merged"], rtol=1e-6, atol=1e-6)


def test_settings_checks():
    def settings(**lora):
        return lora_settings(Config(lora=LoRAConfig(enabled=True, **lora)))

    assert settings(rank=8, alpha=16).scale == 2.0
    with pytest.raises(ValueError, match="rank must be >= 1"):
        settings(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        settings(dropout=1.0)
