"""LoRA on a whole model at TP=2 x PP=2: only the adapters train and sit in the optimizer, the model with
its adapters off is the reference (the base), the weight sync streams merged weights, and the checkpoint,
exported as merged HF weights or as a PEFT adapter, reproduces Megatron's log-probs in transformers
(float32)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from transformers import AutoModelForCausalLM

RANK, ALPHA = 4, 8.0


def nll_loss(logp_BT, entropy_BT, batch):
    mask = batch.loss_mask_BT
    return -(logp_BT * mask).sum(), mask.sum(), {}


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.zeros(4, 12)
    mask[:, 4:] = 1.0
    return tokens, mask


def _train_worker(model_dir: str, ckpt_dir: str, tokens, mask):
    from megareason.config.schema import Config, LoRAConfig, OptimConfig, TrainerConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.lora import adapters_off, lora_modules
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor, Reference
    from megareason.models.train import TrainBatch
    from megareason.rollout.weight_sync import gather_hf_naive, is_consumer, stream_hf_tensors
    from megareason.settings import lora_settings, optimizer_settings

    init_parallel(2, 2)
    ckpt = HFCheckpoint(model_dir)
    cfg = Config(optim=OptimConfig(eps=1e-3), lora=LoRAConfig(enabled=True, rank=RANK, alpha=ALPHA),
                 trainer=TrainerConfig(seed=5))
    actor = Actor(ckpt, optimizer_settings(cfg, 5e-2), lora=lora_settings(cfg))
    adapters = {id(p) for m in lora_modules(actor.model).values() for p in (m.lora_A, m.lora_B)}
    in_optimizer = [p for g in actor.optimizer.param_groups for p in g["params"]]
    frozen = {n: p.detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    logp_before, _ = actor.logprobs(tokens)
    for _ in range(3):
        actor.train_step([TrainBatch(tokens, mask)], nll_loss)
    logp, _ = actor.logprobs(tokens)
    with adapters_off(actor.model):  # the reference policy of a LoRA actor: the frozen base
        logp_off, _ = actor.logprobs(tokens)
    logp_ref = Reference(ckpt).logprobs(tokens)
    streamed = {n: t.clone() for n, t in stream_hf_tensors(actor.model, ckpt.arch)}
    naive = gather_hf_naive(actor.model, ckpt.arch)
    actor.save(ckpt_dir, {"step": 3})
    params = dict(actor.model.named_parameters())
    out = {
        "trainable": sorted(n for n, p in params.items() if p.requires_grad),
        "optimizer_is_adapters": len(in_optimizer) == len(adapters) and {id(p) for p in in_optimizer} == adapters,
        "frozen_unchanged": all(torch.equal(params[n], t) for n, t in frozen.items()),
        "n_frozen": len(frozen),
    }
    if is_consumer():
        out.update(logp=logp, logp_before=logp_before, streamed=streamed, naive=naive, logp_off=logp_off,
                   logp_ref=logp_ref)
    return out


def _export_worker(ckpt_dir: str, merged_dir: str, peft_dir: str):
    from megareason.models.convert import megatron_to_hf

    megatron_to_hf(ckpt_dir, merged_dir)
    megatron_to_hf(ckpt_dir, peft_dir, peft=True)


def _hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama"])  # QKV bias + untied; tied embedding over PP
def test_lora_trains_adapters_only_and_exports_reproduce_megatron(fixture, request, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from megareason.models.build import HFCheckpoint

    model_dir = request.getfixturevalue(fixture)
    arch = HFCheckpoint(model_dir).arch
    tokens, mask = _batch(arch.vocab_size)
    ckpt_dir, merged_dir, peft_dir = tmp_path / "ckpt", tmp_path / "merged", tmp_path / "peft"
    ranks = run_workers(4, _train_worker, str(model_dir), str(ckpt_dir), tokens, mask)
    for r in ranks:  # the base is frozen: only lora_A / lora_B train, and only they are in the optimizer
        assert r["trainable"] and all(n.endswith((".lora_A", ".lora_B")) for n in r["trainable"])
        assert r["optimizer_is_adapters"] and r["frozen_unchanged"] and r["n_frozen"] > 0
    first = ranks[0]
    assert (first["logp"] - first["logp_before"]).abs().max() > 1e-2  # the adapters changed the model
    torch.testing.assert_close(first["logp_off"], first["logp_ref"], rtol=0, atol=1e-6)  # adapters off = base
    # the stream sends merged weights, equal to the naive gather of the merged shards
    assert sorted(first["streamed"]) == sorted(first["naive"])
    for name, t in first["streamed"].items():
        torch.testing.assert_close(t, first["naive"][name], rtol=0, atol=0)

    run_workers(1, _export_worker, str(ckpt_dir), str(merged_dir), str(peft_dir))
    want = first["logp"][:, 1:]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert (_hf_logprobs(merged, tokens) - want).abs().max() < 1e-4
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base_logp = _hf_logprobs(base, tokens)
    peft_model = PeftModel.from_pretrained(base, peft_dir).eval()
    assert (_hf_logprobs(peft_model, tokens) - want).abs().max() < 1e-4
    assert (base_logp - want).abs().max() > 1e-2
    # merged = base + scale * B A, from the PEFT file's factors and the HF base, per HF module
    adapter = load_file(peft_dir / "adapter_model.safetensors")
    merged_sd = load_file(merged_dir / "model.safetensors")
    base_sd = load_file(model_dir / "model.safetensors")
    for hf in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
               "model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        module = "base_model.model." + hf.removesuffix(".weight")
        a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
        torch.testing.assert_close(merged_sd[hf], base_sd[hf] + ALPHA / RANK * b @ a, rtol=1e-5, atol=1e-6)
