"""Weight sync: Megatron (TP=2, PP=2) -> vLLM (TP=1) in place, against independent references."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_workers
from transformers import AutoModelForCausalLM, AutoTokenizer

from megareason.rollout.metrics import logprob_mismatch

QUESTIONS = ["What is 12 + 7 * 3?", "Using 3, 5, 7 make 22.", "Hello there"]
MAX_TOKENS = 16


def test_logprob_mismatch_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, -0.5], [-2.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = logprob_mismatch(trainer, rollout, mask)
    assert got["token_mult_prob_error"] == pytest.approx((math.exp(0.5) + 1 + math.exp(1.0)) / 3)
    assert got["max_abs_logp_diff"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        logprob_mismatch(trainer, rollout, torch.zeros(2, 3))


def _perturb(model, layout, tied: bool, seed: int) -> None:
    """Add noise to every weight, a stand-in for a training step: TP-split weights differently on every
    shard, replicated ones (norms) identically on the TP ranks that share them, the same on every DP
    replica, and a tied model's output layer (the last stage's copy of the embedding, PP > 1) as its
    embedding, as training keeps them."""
    import zlib

    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name.removeprefix("module.")
            if tied and key == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            elif key.startswith("decoder."):  # layer numbers are local to the stage
                key = f"stage {layout.pp_rank} {key}"
            if getattr(p, "tensor_model_parallel", False):
                key += f" tp {layout.tp_rank}"
            g = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _worker(model_dir: str, out_dir: str, prompts: list[list[int]]):
    import torch.distributed as dist

    from megareason.config.schema import Config, ModelConfig, OptimConfig, RolloutConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.convert import write_hf
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import Sampling
    from megareason.rollout.weight_sync import gather_hf_naive, is_consumer, stream_hf_tensors
    from megareason.settings import engine_settings, optimizer_settings

    layout = init_parallel(2, 2)
    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, optimizer_settings(Config(), OptimConfig.lr))
    _perturb(actor.model, layout, ckpt.arch.tie_word_embeddings, seed=100)
    settings = engine_settings(Config(model=ModelConfig(path=model_dir), rollout=RolloutConfig(max_model_len=256)))
    engine = VLLMEngine(settings) if is_consumer() else None
    streamed = []

    def recorded():
        for name, t in stream_hf_tensors(actor.model, ckpt.arch):
            streamed.append((name, t.clone()))
            yield name, t

    if engine is not None:
        stats = engine.update_weights(recorded(), bucket_bytes=64 * 1024)
    else:
        for _ in recorded():
            pass
    naive = gather_hf_naive(actor.model, ckpt.arch)
    result = {}
    sampled = [None]
    if engine is not None:
        result["stats"] = stats
        result["streamed_equal"] = {n: torch.equal(t, naive[n]) for n, t in streamed}
        result["streamed_names"] = sorted(n for n, _ in streamed)
        result["naive_names"] = sorted(naive)
        write_hf(naive, ckpt.dir, out_dir)
        result["greedy"] = [g[0].token_ids for g in engine.generate(
            prompts, Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)]
        groups = engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        sampled = [[(p + c.token_ids, len(p), c.logprobs_T)
                    for p, grp in zip(prompts, groups, strict=True) for c in grp]]
        engine.shutdown()
    dist.broadcast_object_list(sampled, src=0)
    rows = sampled[0]
    width = max(len(t) for t, _, _ in rows)
    tokens = torch.tensor([t + [0] * (width - len(t)) for t, _, _ in rows])
    logp, _ = actor.logprobs(tokens, micro_batch_size=2)
    if layout.tp_rank == 0 and layout.pp_rank == 0:
        rollout = torch.zeros_like(logp)
        mask = torch.zeros_like(logp)
        for i, (t, start, lps) in enumerate(rows):
            rollout[i, start : len(t)] = torch.tensor(lps)
            mask[i, start : len(t)] = 1.0
        result["mismatch"] = logprob_mismatch(logp, rollout, mask)
    return result


@pytest.mark.slow
# Qwen3 (per-head q/k norms, head_dim apart from hidden/heads, tied embeddings over PP). Qwen2 (QKV bias,
# untied) syncs from TP 2 x PP 2 into vLLM TP 2 engines in test_colocated.py, greedy against transformers.
def test_sync_tp2_pp2_into_vllm_matches_transformers(tiny_qwen3, tmp_path):
    model_dir = tiny_qwen3
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in QUESTIONS]
    out = tmp_path / "perturbed"
    result = run_workers(4, _worker, str(model_dir), str(out), prompts)[0]

    assert result["streamed_names"] == result["naive_names"] and all(result["streamed_equal"].values())
    assert result["stats"].buckets > 3  # really bucketed
    # every byte of the model moved once (the file is the same tensors plus a header)
    file = out / "model.safetensors"
    assert result["stats"].bytes == file.stat().st_size - _header_bytes(file)
    perturbed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for ids, got in zip(prompts, result["greedy"], strict=True):
            kw = dict(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id)
            want = perturbed.generate(torch.tensor([ids]), **kw)[0, len(ids):].tolist()
            assert got == want
    before = [original.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=tok.eos_token_id)[0, len(ids):].tolist() for ids in prompts]
    assert before != result["greedy"]  # the sync changed what vLLM generates
    assert result["mismatch"]["token_mult_prob_error"] < 1.001
    assert result["mismatch"]["max_abs_logp_diff"] < 1e-3


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _replica_worker(model_dir: str, prompts: list[list[int]]):
    """TP=2 x DP=2: each data-parallel replica feeds its own engine from its own shards."""
    from megareason.config.schema import Config, ModelConfig, OptimConfig, RolloutConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import Sampling
    from megareason.rollout.weight_sync import gather_hf_naive, is_consumer, stream_hf_tensors
    from megareason.settings import engine_settings, optimizer_settings

    layout = init_parallel(2, 1)
    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, optimizer_settings(Config(), OptimConfig.lr))
    _perturb(actor.model, layout, ckpt.arch.tie_word_embeddings, seed=300)
    settings = engine_settings(Config(model=ModelConfig(path=model_dir), rollout=RolloutConfig(max_model_len=256)))
    engine = VLLMEngine(settings) if is_consumer() else None
    if engine is not None:
        engine.update_weights(stream_hf_tensors(actor.model, ckpt.arch), bucket_bytes=1 << 20)
    else:
        for _ in stream_hf_tensors(actor.model, ckpt.arch):
            pass
    naive = gather_hf_naive(actor.model, ckpt.arch)
    if engine is None:
        return None
    greedy = [c[0].token_ids for c in engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS),
                                                      use_tqdm=False)]
    engine.shutdown()
    return {"dp_rank": layout.dp_rank, "greedy": greedy, "weights": naive}


@pytest.mark.slow
def test_each_data_parallel_replica_feeds_its_own_engine(tiny_llama, tmp_path):
    from megareason.models.convert import write_hf

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in QUESTIONS]
    results = [r for r in run_workers(4, _replica_worker, str(tiny_llama), prompts) if r is not None]
    assert sorted(r["dp_rank"] for r in results) == [0, 1]
    write_hf(results[0]["weights"], tiny_llama, tmp_path / "perturbed")
    perturbed = AutoModelForCausalLM.from_pretrained(tmp_path / "perturbed", dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [perturbed.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
                for ids in prompts]
    for r in results:
        assert r["greedy"] == want


def _failing_load_worker(model_dir: str):
    """TP=2: a load that raises on one rank, mid-stream and after the stream's last tensor; then a clean sync."""
    import time

    import torch.distributed as dist

    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor
    from megareason.rollout.weight_sync import SyncGuard, WeightSyncError, guarded_sync, stream_hf_tensors
    from megareason.settings import optimizer_settings

    init_parallel(2, 1)
    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, optimizer_settings(Config(), OptimConfig.lr))
    rank, out = dist.get_rank(), {}

    def sync(every_rank: bool, fails_at: int | None, failing_rank: int) -> tuple[str | None, float, int]:
        guard, loaded = SyncGuard(), []

        def load():  # what an engine's update_weights does with the stream
            stream = stream_hf_tensors(actor.model, ckpt.arch, every_rank=every_rank, guard=guard)
            guard.streams.append(stream)
            for name, _ in stream:
                if rank == failing_rank and len(loaded) == fails_at:
                    raise ValueError(f"vLLM refused {name}: shape mismatch")
                loaded.append(name)
            if rank == failing_rank and fails_at == -1:  # the last bucket, after the stream's end
                raise RuntimeError("CUDA out of memory while waking the KV cache")

        start = time.monotonic()
        try:
            guarded_sync(guard, load)
            error = None
        except WeightSyncError as e:
            error = str(e)
        return error, time.monotonic() - start, len(loaded)

    out["mid_stream"] = sync(True, 2, failing_rank=1)  # colocated: every rank loads every tensor
    out["after_stream"] = sync(False, -1, failing_rank=0)  # per replica: the consumer's last load fails
    out["clean"] = sync(True, None, failing_rank=1)
    return out


def test_a_load_that_fails_on_one_rank_stops_every_rank_with_its_error(tiny_llama):
    ranks = run_workers(2, _failing_load_worker, str(tiny_llama), timeout=120)
    for case, message in (("mid_stream", "weight sync failed on rank 1: ValueError: vLLM refused"),
                          ("after_stream", "weight sync failed on rank 0: RuntimeError: CUDA out of memory")):
        for rank, out in enumerate(ranks):
            error, seconds, _ = out[case]
            assert error is not None and error.startswith(message), (case, rank, error)
            assert seconds < 5, (case, rank, seconds)
    assert ranks[1]["mid_stream"][2] == 2  # rank 1 stopped loading where it failed
    assert ranks[0]["mid_stream"][2] < ranks[0]["clean"][2]  # rank 0 stopped too, at the next check
    assert all(out["clean"][0] is None for out in ranks) and ranks[0]["clean"][2] == ranks[1]["clean"][2] > 0
