"""Colocated SPMD engines (``rollout.colocated``): vLLM TP ranks inside the trainer's Megatron ranks.

The Ray path (``megareason train`` with rollout.tensor_parallel_size=2) is in test_train_e2e.py; here four
gloo processes hold Megatron's groups (TP=2 x PP=2) as the trainer's workers do, and two vLLM engines of
TP=2 run on ranks [0, 1] and [2, 3], independently of the training layout.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from test_weight_sync import MAX_TOKENS, QUESTIONS
from transformers import AutoModelForCausalLM, AutoTokenizer

from megareason.config import ConfigError, load_config, validate_training
from megareason.rollout.colocated import STOP_AGREE_STEPS, colocated_engine_args, rollout_layout
from megareason.settings import engine_settings


def test_rollout_layout_takes_consecutive_ranks_and_a_bad_size_names_the_field():
    got = [rollout_layout(8, r, 4) for r in range(8)]
    assert [(x.engine, x.engine_rank, x.leader) for x in got[3:6]] == [(0, 3, False), (1, 0, True), (1, 1, False)]
    assert {x.engines for x in got} == {2}
    assert rollout_layout(64, 63, 8).engine == 7  # the 70B recipe: 8 engines of TP 8 on 64 GPUs
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=4 must divide .* 6 ranks"):
        rollout_layout(6, 0, 4)
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size must divide the trainer's world size "
                                          r"TP x PP x DP = 6"):
        validate_training(load_config("grpo_smollm2_cpu", ["parallel.data_parallel_size=3",
                                                           "parallel.tensor_model_parallel_size=2",
                                                           "rollout.tensor_parallel_size=4"]))


def test_custom_all_reduce_cannot_map_a_peer_in_a_one_gpu_rank(monkeypatch):
    """Why the colocated GPU engine turns custom all-reduce off: vLLM's P2P check (``_can_p2p``, run by
    ``CustomAllreduce`` on every TP rank) maps each peer's local rank through the visible devices, and a
    trainer rank (a Ray actor with one GPU) sees one. Reproduced with vLLM's own functions and a platform
    that reads CUDA_VISIBLE_DEVICES as vLLM's CUDA platform does (vllm.platforms.cuda needs CUDA to import)."""
    import vllm.distributed.device_communicators.custom_all_reduce as car
    from vllm.platforms.interface import Platform, get_assigned_physical_gpu_ids

    class CudaLike(Platform):
        device_control_env_var = "CUDA_VISIBLE_DEVICES"  # CudaPlatformBase's; the mapping is Platform's

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # what Ray gives a one-GPU actor
    monkeypatch.setattr(car, "current_platform", CudaLike)
    assert get_assigned_physical_gpu_ids() is None  # no explicit mapping: the env var decides
    assert CudaLike.logical_device_id_to_visible_device_id(0) == 0
    with pytest.raises(IndexError):
        CudaLike.logical_device_id_to_visible_device_id(1)
    for rank in (0, 1):  # each rank maps its peer: both of a TP 2 engine fail
        with pytest.raises(IndexError):
            car._can_p2p(rank, 2)


def test_the_colocated_engine_turns_off_the_all_reduces_that_need_every_gpu_visible():
    """The engine arguments a colocated rank builds for vLLM (on GPU as on CPU): FlashInfer's all-reduce off
    unless the site set VLLM_ALLREDUCE_USE_FLASHINFER, and then as the site set it."""
    extra, env = colocated_engine_args({"worker_extension_cls": "x.Y"}, environ={})
    assert extra == {"worker_extension_cls": "x.Y", "distributed_executor_backend": "external_launcher",
                     "disable_custom_all_reduce": True}
    assert env == {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
    for site in ("1", "0"):
        _, env = colocated_engine_args({}, environ={"VLLM_ALLREDUCE_USE_FLASHINFER": site})
        assert env == {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}  # the site's value stays in the environment
    # what vLLM then reads (envs.py): off by default here, on when the site says 1
    import vllm.envs as envs

    for environ, want in (({}, False), ({"VLLM_ALLREDUCE_USE_FLASHINFER": "1"}, True)):
        _, env = colocated_engine_args({}, environ=environ)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("VLLM_ALLREDUCE_USE_FLASHINFER", raising=False)
            for k, v in {**environ, **env}.items():
                mp.setenv(k, v)
            assert envs.VLLM_ALLREDUCE_USE_FLASHINFER is want


def _worker(model_dir: str, out_dir: str, prompts: list[list[int]]):
    import torch.distributed as dist

    from megareason.config.schema import Config, ModelConfig, OptimConfig, RolloutConfig
    from megareason.models.build import HFCheckpoint
    from megareason.models.convert import write_hf
    from megareason.models.parallel import init_parallel
    from megareason.models.roles import Actor
    from megareason.rollout.colocated import ColocatedEngine
    from megareason.rollout.records import Sampling
    from megareason.rollout.weight_sync import gather_hf_naive, stream_hf_tensors
    from megareason.settings import engine_settings, optimizer_settings

    layout = init_parallel(2, 2)
    ckpt = HFCheckpoint(model_dir)
    actor = Actor(ckpt, optimizer_settings(Config(), OptimConfig.lr))
    engine = ColocatedEngine(engine_settings(Config(model=ModelConfig(path=model_dir),
                                                   rollout=RolloutConfig(max_model_len=256, tensor_parallel_size=2))))
    greedy = Sampling(n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    mine = prompts[engine.layout.engine :: engine.layout.engines]  # each engine its own prompts
    before = [c[0].token_ids for c in engine.generate(mine, greedy, use_tqdm=False)]
    # Perturb every weight as in test_weight_sync (TP-split weights per shard, replicated ones per stage).
    split = torch.Generator().manual_seed(100 + dist.get_rank())
    shared = torch.Generator().manual_seed(200 + layout.pp_rank)
    with torch.no_grad():
        for p in actor.model.parameters():
            g = split if getattr(p, "tensor_model_parallel", False) else shared
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    stats = engine.update_weights(stream_hf_tensors(actor.model, ckpt.arch, every_rank=True), bucket_bytes=1 << 16)
    after = [c[0].token_ids for c in engine.generate(mine, greedy, use_tqdm=False)]
    unseeded = [[c.token_ids for c in group] for group in
                engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=8), use_tqdm=False)]
    # A stop that only each engine's second rank sees, at its second look: both ranks of the engine give the
    # generation up at the same agreed engine step, and the engine generates as before afterwards.
    import megareason.rollout.engine as engine_module
    from megareason.rollout.records import GenerationStopped

    engine_module.STOP_POLL_S = 0.0
    looks = []
    engine.should_stop = lambda: looks.append(1) or (engine.layout.engine_rank == 1 and len(looks) >= 2)
    try:
        engine.generate(mine, greedy, use_tqdm=False)
        stopped = None
    except GenerationStopped as e:
        stopped = str(e)
    engine.should_stop = None
    again = [c[0].token_ids for c in engine.generate(mine, greedy, use_tqdm=False)]
    engine.shutdown()
    naive = gather_hf_naive(actor.model, ckpt.arch)
    if naive is not None:
        write_hf(naive, ckpt.dir, out_dir)
    # vLLM's process groups over the same processes leave Megatron's working
    logp, _ = actor.logprobs(torch.tensor([prompts[0]]), micro_batch_size=1)
    return {"engine": engine.layout.engine, "engine_rank": engine.layout.engine_rank, "mine": mine,
            "before": before, "after": after, "unseeded": unseeded, "bytes": stats.bytes, "logp": logp,
            "stopped": stopped, "again": again}


@pytest.mark.slow
def test_two_tp2_engines_in_a_tp2_pp2_trainer_take_the_sync_exactly(tiny_qwen2, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in QUESTIONS]
    out = tmp_path / "perturbed"
    results = run_workers(4, _worker, str(tiny_qwen2), str(out), prompts)

    assert [(r["engine"], r["engine_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    perturbed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()

    def hf_greedy(model, ids):
        return model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()

    with torch.inference_mode():
        for r in results:
            assert r["before"] == [hf_greedy(original, ids) for ids in r["mine"]]
            assert r["after"] == [hf_greedy(perturbed, ids) for ids in r["mine"]]
            assert r["after"] != r["before"]
    # the engines served different prompts; the ranks of one engine sampled identically (SPMD), unseeded
    # sampling differs between engines
    assert results[0]["mine"] != results[2]["mine"]
    assert results[0]["unseeded"] == results[1]["unseeded"] and results[2]["unseeded"] == results[3]["unseeded"]
    assert results[0]["unseeded"] != results[2]["unseeded"]
    # a stop seen by one rank of each engine: every rank stopped at the same agreed step (STOP_AGREE_STEPS)
    for r in results:
        assert r["stopped"] == (f"generation of {len(r['mine'])} prompts stopped after {STOP_AGREE_STEPS} engine "
                                "steps: the run is stopping"), r["stopped"]
        assert r["again"] == r["after"]
    # every rank loaded the whole model (each vLLM rank keeps its slice of each whole tensor)
    file = out / "model.safetensors"
    with open(file, "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    assert {r["bytes"] for r in results} == {file.stat().st_size - header}
    # after the engines ran and shut down, Megatron (TP 0, PP 0 holds the result) still scores as transformers
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        want = torch.log_softmax(perturbed(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert (results[0]["logp"][0, 1:] - want).abs().max() < 1e-4


def test_the_engine_pins_vllms_model_runner_to_the_configured_one():
    """rollout.model_runner reaches vLLM as VLLM_USE_V2_MODEL_RUNNER, and vLLM's own choice
    (``VllmConfig.use_v2_model_runner``, config/vllm.py) then follows it: unpinned, vLLM 0.32 takes Model
    Runner V2 wherever Triton is installed (a GPU image), V1 here (no Triton)."""
    from types import SimpleNamespace

    import vllm.config.vllm as vllm_config

    from megareason.rollout.engine import engine_arguments

    cfg = load_config("grpo_smollm2_cpu", [])
    assert cfg.rollout.model_runner == "v1"
    gpu_kwargs, env = engine_arguments(engine_settings(cfg), on_cpu=False)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert gpu_kwargs["enable_sleep_mode"] is True and "enable_chunked_prefill" not in gpu_kwargs
    cpu_kwargs, _ = engine_arguments(engine_settings(cfg), on_cpu=True)
    assert cpu_kwargs["enable_chunked_prefill"] is False and "enable_sleep_mode" not in cpu_kwargs
    _, v2 = engine_arguments(engine_settings(load_config("grpo_smollm2_cpu", ["rollout.model_runner=v2"])), False)
    assert v2 == {"VLLM_USE_V2_MODEL_RUNNER": "1"}

    # vLLM's decision on a GPU image: Triton present, no feature V2 lacks
    plain = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), watermark_config=None,
                            _get_v2_model_runner_unsupported_features=lambda: [])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_config, "HAS_TRITON", True)
        for pinned, want in ((None, True), (env, False), (v2, True)):
            mp.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
            for k, v in (pinned or {}).items():
                mp.setenv(k, v)
            assert vllm_config.VllmConfig.use_v2_model_runner.fget(plain) is want, pinned
