"""How the trainer runs at scale, on CPU with the code the GPU runs (2 gloo processes): bf16 mixed
precision against fp32 and transformers, megatron-core's activation recomputation and sequence
parallelism against the plain build."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from transformers import AutoModelForCausalLM

from megareason.models.arch import ModelArch

LR = 1e-3


def _batch(vocab: int, rows: int = 4, width: int = 16):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.zeros(rows, width)
    for i in range(rows):
        mask[i, 3 + i % 3 : width - i % 4] = 1.0
    return tokens, mask


def nll_loss(logp_BT, entropy_BT, batch):
    mask = batch.loss_mask_BT
    return -(logp_BT * mask).sum(), mask.sum(), {}


def _compute(precision="fp32", recompute="none", layers=0, sp=False):
    from megareason.models.build import ComputeSettings

    return ComputeSettings(precision=precision, recompute=recompute, recompute_num_layers=layers, sequence_parallel=sp,
                           moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)


def _grads_and_saved(model_dir, compute, tokens, mask, tp, lora=False):
    """One forward/backward of the NLL through megatron-core's schedule: log-probs, gradients (full HF
    tensors on TP rank 0) and the activation bytes saved for backward by a plain forward."""
    from megareason.config.schema import Config
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.memory import SavedActivations
    from megareason.models.packing import pack_shared, plan_shared
    from megareason.models.parallel import current_layout, init_parallel
    from megareason.models.schedule import TokenBatch, forward_backward, forward_outputs
    from megareason.models.train import TrainBatch, wrap_for_training
    from megareason.settings import optimizer_settings

    init_parallel(tp, 1)
    ckpt = HFCheckpoint(model_dir)
    model = build_gpt(ckpt.arch, compute)
    load_hf_weights(model, ckpt)
    if lora:  # frozen base: megatron-core's reentrant full recompute needs its input to require grad
        from megareason.models.lora import LoRASettings, apply_lora

        apply_lora(model, LoRASettings(rank=4, alpha=8.0, dropout=0.0, seed=0,
                                       targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")))
        with torch.no_grad():  # B != 0 (it starts at 0), so A and the layers' inputs get gradients too
            for n, p in model.named_parameters():
                if n.endswith("lora_B"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    ddp, _ = wrap_for_training(model, optimizer_settings(Config(), LR))
    head = logprob_head(ckpt.arch.vocab_size)
    logp = torch.cat([o[0] for o in forward_outputs(ddp, [TokenBatch(t) for t in tokens.split(2)], head, 2)])
    # The responses-only head (the trainer's path): the LM head runs on the scored positions only.
    keep = torch.nonzero(mask[0, 1:]).flatten()
    kept = forward_outputs(ddp, [TokenBatch(tokens[:1], keep_W=keep)], head, 2)[0][0]
    # Two sequences sharing a 5-token prompt, packed as the trainer packs them (width a multiple of TP).
    seqs = [tokens[0], torch.cat([tokens[0, :5], tokens[1, 5:]])]
    (mb,) = pack_shared(seqs, [5, 5], plan_shared([16, 16], [[0, 1]], 64), multiple=tp)
    assert mb.shared.tokens_1P.shape[1] % tp == 0
    shared = forward_outputs(ddp, [TokenBatch(mb.tokens_BT, mb.cu_seqlens, shared=mb.shared)], head, 2)[0][0]
    refused = ""
    if compute.sequence_parallel:  # an odd width cannot be split over 2 ranks: a clear error, not megatron's assert
        try:
            forward_outputs(ddp, [TokenBatch(tokens[:, :15])], head, 2)
        except ValueError as e:
            refused = str(e)
    forward_backward(ddp, [TrainBatch(t, m) for t, m in zip(tokens.split(2), mask.split(2), strict=True)],
                     head, nll_loss)
    grads = {n: p.main_grad.detach().float().clone() for n, p in ddp.module.named_parameters() if p.requires_grad}
    layout = current_layout()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    ddp.train()
    with SavedActivations(ddp) as saved:
        logits = ddp(tokens, positions, attention_mask=None)
    logits.float().sum().backward()
    return {"logp": logp, "kept": kept, "shared": shared, "grads": grads, "saved": saved.bytes,
            "tp_rank": layout.tp_rank, "refused": refused}


def _critic(model_dir, compute, tokens, mask):
    """The critic's values and the gradients of a value loss (its fp32 value head on the trunk)."""
    from megareason.config.schema import Config
    from megareason.models.build import HFCheckpoint
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Critic
    from megareason.models.schedule import forward_backward
    from megareason.models.train import TrainBatch
    from megareason.settings import optimizer_settings

    init_parallel(2, 1)
    critic = Critic(HFCheckpoint(model_dir), optimizer_settings(Config(), LR), compute)
    with torch.no_grad():  # the head starts at zero; make it read the trunk
        critic.model.output_layer.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    values = critic.values(tokens, micro_batch_size=2)

    def value_loss(values_BT, batch):
        return ((values_BT - 1.0) ** 2 * batch.loss_mask_BT).sum(), batch.loss_mask_BT.sum(), {}

    forward_backward(critic.ddp, [TrainBatch(t, m) for t, m in zip(tokens.split(2), mask.split(2), strict=True)],
                     critic.head, value_loss)
    grads = {n: p.main_grad.detach().clone() for n, p in critic.ddp.module.named_parameters()}
    return {"values": values, "grads": grads, "head_dtype": critic.model.output_layer.weight.dtype}


def _recompute_and_sp_worker(model_dir, tokens, mask):
    out = {}
    for name, compute, tp in [("plain", _compute(), 2), ("selective", _compute(recompute="selective"), 2),
                              ("full", _compute(recompute="full"), 2),
                              ("full_block1", _compute(recompute="full", layers=1), 2),
                              ("sp", _compute(sp=True), 2), ("sp_full", _compute(recompute="full", sp=True), 2)]:
        out[name] = _grads_and_saved(model_dir, compute, tokens, mask, tp)
    for name, compute in [("lora", _compute()), ("lora_full", _compute(recompute="full")),
                          ("lora_sp", _compute(sp=True))]:
        out[name] = _grads_and_saved(model_dir, compute, tokens, mask, 2, lora=True)
    out["critic"] = _critic(model_dir, _compute(), tokens, mask)
    out["critic_sp_bf16"] = _critic(model_dir, _compute("bf16", sp=True), tokens, mask)
    out["critic_sp"] = _critic(model_dir, _compute(sp=True), tokens, mask)
    return out


@pytest.fixture(scope="module")
def recompute_and_sp(tiny_qwen2):
    arch = ModelArch.from_pretrained(tiny_qwen2)
    tokens, mask = _batch(arch.vocab_size)
    return run_workers(2, _recompute_and_sp_worker, str(tiny_qwen2), tokens, mask)


@pytest.mark.parametrize("variant", ["selective", "full", "full_block1"])
def test_recomputation_keeps_gradients_and_saves_fewer_activations(recompute_and_sp, variant):
    for rank in recompute_and_sp:
        plain, other = rank["plain"], rank[variant]
        for name, g in plain["grads"].items():
            assert (other["grads"][name] - g).abs().max().item() <= 1e-6, f"{variant} {name}"
        assert torch.equal(other["logp"], plain["logp"])
        assert other["saved"] < plain["saved"], f"{variant}: {other['saved']} >= {plain['saved']} bytes saved"
    full, block = recompute_and_sp[0]["full"]["saved"], recompute_and_sp[0]["full_block1"]["saved"]
    assert full <= block < recompute_and_sp[0]["plain"]["saved"]  # the tiny model has 2 layers: block 1 recomputes one


@pytest.mark.parametrize("variant", ["sp", "sp_full"])
def test_sequence_parallel_matches_tensor_parallel(recompute_and_sp, variant):
    for rank in recompute_and_sp:
        plain, sp = rank["plain"], rank[variant]
        assert (sp["logp"] - plain["logp"]).abs().max().item() <= 1e-6
        assert (sp["kept"] - plain["kept"]).abs().max().item() <= 1e-6
        assert (sp["shared"] - plain["shared"]).abs().max().item() <= 1e-6
        for name, g in plain["grads"].items():
            assert (sp["grads"][name] - g).abs().max().item() <= 1e-6, f"{variant} {name}"
        # The activations outside the tensor-parallel regions are split over the 2 TP ranks.
        assert sp["saved"] < plain["saved"]
    assert recompute_and_sp[0]["sp"]["grads"].keys() == recompute_and_sp[0]["plain"]["grads"].keys()
    assert "row width 15 must be a multiple" in recompute_and_sp[0][variant]["refused"]


def _bf16_worker(model_dir, tokens, mask, export_dir):
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.parallel import init_parallel
    from megareason.models.schedule import TokenBatch, forward_backward, forward_outputs
    from megareason.models.train import TrainBatch, wrap_for_training
    from megareason.settings import optimizer_settings

    init_parallel(1, 1)
    ckpt = HFCheckpoint(model_dir)
    head = logprob_head(ckpt.arch.vocab_size)
    out = {}
    for precision in ("fp32", "bf16"):
        model = build_gpt(ckpt.arch, _compute(precision))
        load_hf_weights(model, ckpt)
        # A tiny learning rate: Adam's first step moves every weight by ~LR, well under bf16's resolution.
        ddp, opt = wrap_for_training(model, optimizer_settings(Config(optim=OptimConfig(clip_grad=1e9)), 1e-5))
        out[precision] = {
            "logp": torch.cat([o[0] for o in forward_outputs(ddp, [TokenBatch(t) for t in tokens.split(2)], head, 2)]),
            "dtype": next(ddp.module.parameters()).dtype,
        }
        if precision == "bf16":
            before = {n: p.detach().float().clone() for n, p in ddp.module.named_parameters()}
            opt.zero_grad()
            forward_backward(ddp, [TrainBatch(t, m) for t, m in zip(tokens.split(2), mask.split(2), strict=True)],
                             head, nll_loss)
            grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
            ok, _, _ = opt.step()
            assert ok
            inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
            main = {}
            names = {id(p): n for n, p in ddp.module.named_parameters()}
            for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups, strict=True):
                for p, m in zip(model_group, main_group, strict=True):
                    main[names[id(p)]] = m.detach().clone()
            out["bf16"].update(before=before, grads=grads, main=main,
                               after={n: p.detach().clone() for n, p in ddp.module.named_parameters()})
            # The checkpoint keeps both; the HF export writes either, in the dtype asked for.
            from megareason.models.checkpoint import save_checkpoint
            from megareason.models.convert import megatron_to_hf

            save_checkpoint(f"{export_dir}/ckpt", model, ckpt.arch, model_dir, opt, {"precision": "bf16"})
            for dtype in ("auto", "bfloat16"):
                megatron_to_hf(f"{export_dir}/ckpt", f"{export_dir}/hf_{dtype}", dtype=dtype)
    # The same step under the distributed optimizer: its checkpoint exports the same main weights.
    model = build_gpt(ckpt.arch, _compute("bf16"))
    load_hf_weights(model, ckpt)
    sharded = Config(optim=OptimConfig(clip_grad=1e9, use_distributed_optimizer=True))
    ddp, opt = wrap_for_training(model, optimizer_settings(sharded, 1e-5))
    opt.zero_grad()
    forward_backward(ddp, [TrainBatch(t, m) for t, m in zip(tokens.split(2), mask.split(2), strict=True)], head,
                     nll_loss)
    assert opt.step()[0]
    save_checkpoint(f"{export_dir}/ckpt_dist", model, ckpt.arch, model_dir, opt, {"precision": "bf16"})
    from megareason.models import convert

    convert.MAX_SHARD_BYTES = 400_000  # this export in several shards (as a model over 5 GiB is written)
    megatron_to_hf(f"{export_dir}/ckpt_dist", f"{export_dir}/hf_dist", dtype="float32")
    return out


@pytest.fixture(scope="module")
def bf16_run(tiny_qwen2, tmp_path_factory):
    arch = ModelArch.from_pretrained(tiny_qwen2)
    tokens, mask = _batch(arch.vocab_size)
    export = tmp_path_factory.mktemp("bf16_export")
    return tokens, mask, run_workers(1, _bf16_worker, str(tiny_qwen2), tokens, mask, str(export))[0], export


def _hf_logp(model, tokens):
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def test_bf16_logprobs_are_as_close_to_fp32_as_transformers_bf16(bf16_run, tiny_qwen2):
    tokens, mask, out, _ = bf16_run
    assert out["fp32"]["dtype"] == torch.float32 and out["bf16"]["dtype"] == torch.bfloat16
    hf32 = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.bfloat16).eval()
    scored = mask[:, 1:] > 0
    hf_err = (_hf_logp(hf16, tokens) - _hf_logp(hf32, tokens))[scored].abs().mean().item()
    ours_err = (out["bf16"]["logp"][:, 1:] - out["fp32"]["logp"][:, 1:])[scored].abs().mean().item()
    fp32_vs_hf = (out["fp32"]["logp"][:, 1:] - _hf_logp(hf32, tokens))[scored].abs().max().item()
    assert fp32_vs_hf < 1e-5
    assert 0 < hf_err and 0 < ours_err <= 1.5 * hf_err, \
        f"megatron bf16 {ours_err:.2e} vs transformers bf16 {hf_err:.2e}"


def test_bf16_adamw_step_keeps_fp32_main_weights(bf16_run):
    _, _, out, _ = bf16_run
    b = out["bf16"]
    moved_main, moved_bf16, with_grad = 0, 0, 0
    for name, w0 in b["before"].items():
        # torch's AdamW in fp32 from the same starting weights and the same (fp32-accumulated) gradient.
        ref = w0.clone().requires_grad_(True)
        ref.grad = b["grads"][name].clone()
        torch.optim.AdamW([ref], lr=1e-5, weight_decay=0.0, eps=1e-8).step()
        main = b["main"][name]
        assert main.dtype == torch.float32
        assert (main - ref.detach()).abs().max().item() <= 1e-7, name
        # The model's bf16 weights are the main weights rounded to bf16.
        assert torch.equal(b["after"][name], main.to(torch.bfloat16))
        moved_main += int((main != w0).sum())
        moved_bf16 += int((b["after"][name].float() != w0).sum())
        with_grad += int((b["grads"][name] != 0).sum())
    # An update of ~1e-5 moves every fp32 main weight that has a gradient, but rounds away in most of
    # the bf16 weights (had the update been applied in bf16, it would be lost).
    assert moved_main == with_grad and moved_bf16 < 0.5 * moved_main, (moved_main, with_grad, moved_bf16)


def test_hf_export_of_a_bf16_checkpoint_writes_main_or_model_weights(bf16_run, tiny_qwen2):
    from safetensors.torch import load_file

    from megareason.models import weight_map

    _, _, out, export = bf16_run
    arch = ModelArch.from_pretrained(tiny_qwen2)
    main = weight_map.to_hf({(0, 0): out["bf16"]["main"]}, arch, 1, 1)
    model = weight_map.to_hf({(0, 0): out["bf16"]["after"]}, arch, 1, 1)
    # auto: the source model's dtype (the tiny model is float32), from the fp32 main weights
    auto = load_file(export / "hf_auto" / "model.safetensors")
    bf16 = load_file(export / "hf_bfloat16" / "model.safetensors")
    assert auto.keys() == bf16.keys() == main.keys()
    for name in main:
        assert auto[name].dtype == torch.float32 and torch.equal(auto[name], main[name]), name
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], model[name]), name
    assert any(not torch.equal(auto[n], bf16[n].float()) for n in main)  # they differ: main weights are finer
    # The distributed optimizer's export, written in shards with their index: transformers loads it whole.
    from transformers import AutoModelForCausalLM

    shards = sorted(p.name for p in (export / "hf_dist").glob("model-*.safetensors"))
    assert len(shards) >= 2 and (export / "hf_dist" / "model.safetensors.index.json").is_file(), shards
    dist = AutoModelForCausalLM.from_pretrained(export / "hf_dist", dtype=torch.float32).state_dict()
    assert all(torch.equal(dist[n], main[n]) for n in main)


@pytest.mark.parametrize("variant", ["lora_full", "lora_sp"])
def test_lora_adapters_get_the_same_gradients_under_recomputation_and_sequence_parallelism(recompute_and_sp, variant):
    for rank in recompute_and_sp:
        plain, other = rank["lora"]["grads"], rank[variant]["grads"]
        assert plain and all("lora_" in n for n in plain)  # only the adapters train
        assert all(g.abs().max() > 0 for g in plain.values())  # A's gradients too
        for name, g in plain.items():
            assert (other[name] - g).abs().max().item() <= 1e-6, name
        assert (rank[variant]["logp"] - rank["lora"]["logp"]).abs().max().item() <= 1e-6


def test_critic_value_head_under_sequence_parallelism_and_bf16(recompute_and_sp):
    for rank in recompute_and_sp:
        plain, sp, bf16 = rank["critic"], rank["critic_sp"], rank["critic_sp_bf16"]
        assert (sp["values"] - plain["values"]).abs().max().item() <= 1e-6
        for name, g in plain["grads"].items():
            assert (sp["grads"][name] - g).abs().max().item() <= 1e-6, name
        # bf16 trunk, fp32 head: the head's weights and values stay float32, close to fp32's
        assert bf16["head_dtype"] == torch.float32 and plain["head_dtype"] == torch.float32
        assert bf16["values"].dtype == torch.float32
        diff = (bf16["values"] - plain["values"]).abs()
        assert 0 < diff.mean().item() < 0.05 * plain["values"].abs().mean().item()  # bf16's ~3 digits, 2 layers
