"""`megareason plan`: memory numbers against hand-computed values, refusals, and the CLI's exit codes."""

from __future__ import annotations

import pytest

from megareason.cli import main
from megareason.config import load_config
from megareason.launch.plan import (
    GPUS,
    MODEL_SHAPES,
    PlanError,
    PlanOptions,
    activation_bytes_per_token_layer,
    decode_step_seconds,
    kv_bytes_per_token,
    lora_params_per_gpu,
    make_plan,
    params_per_gpu,
    plan_config,
    total_params,
)
from megareason.models.arch import ArchError, ModelArch

# 4 layers, hidden 64, ffn 128, 4 heads / 2 kv heads of 16, vocab 100, untied: small enough to count by hand.
SMALL = ModelArch(family="llama", vocab_size=100, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling_factor=0.0,
                  max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False)
# Per layer: q 64x64 + k,v 2 x 64x32 + o 64x64 = 12288, MLP 3 x 64x128 = 24576, two norms 2 x 64.
LAYER = 12288 + 24576
EMBEDDING = 100 * 64


def _cfg(*overrides: str):
    return load_config("grpo_smollm2_cpu", ["rollout.dtype=bfloat16", "rollout.enforce_eager=false", *overrides])


def test_parameter_counts_by_hand():
    assert total_params(SMALL) == 4 * (LAYER + 128) + EMBEDDING + EMBEDDING + 64
    # TP 2 x PP 2: 2 layers per stage, linear weights halved, norms replicated; the last stage adds the
    # final norm and its half of the output layer (the first stage's half embedding is 64 smaller).
    assert params_per_gpu(SMALL, 2, 2) == 2 * (LAYER // 2 + 128) + EMBEDDING // 2 + 64 == 40384
    tied = ModelArch(**{**SMALL.__dict__, "tie_word_embeddings": True})
    assert params_per_gpu(tied, 1, 1) == total_params(SMALL) - EMBEDDING  # one shared matrix at PP = 1
    assert params_per_gpu(tied, 1, 2) == params_per_gpu(SMALL, 1, 2)  # the last stage keeps its own copy


def test_activation_and_kv_bytes_by_hand():
    # 8h bytes replicated over TP + 2 bytes x (2q + 2kv + 3f) / TP: 512 + 2 * (128 + 64 + 384) / 2.
    assert activation_bytes_per_token_layer(SMALL, 2) == 512 + 576 == 1088
    # K and V, 4 layers, 2 kv heads of 16, bf16; with vLLM TP 4 each GPU keeps one (replicated) kv head.
    assert kv_bytes_per_token(SMALL, 1, 2) == 2 * 4 * 2 * 16 * 2 == 512
    assert kv_bytes_per_token(SMALL, 2, 2) == kv_bytes_per_token(SMALL, 4, 2) == 256


def test_memory_lines_of_a_small_plan():
    cfg = _cfg("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
               "parallel.data_parallel_size=2", "trainer.micro_batch_tokens=1024")
    n = 40384
    for dist, optimizer in (("off", 12 * n), ("on", 12 * n / 2)):
        plan = make_plan(cfg, SMALL, PlanOptions(nodes=1, gpus_per_node=8, distributed_optimizer=dist, recompute="off"))
        train = plan.memory["training"]
        assert train["parameters (bf16)"] == 2 * n
        assert train["gradients (fp32)"] == 4 * n
        assert sum(v for k, v in train.items() if k.startswith("optimizer")) == optimizer
        assert plan.distributed_optimizer == (dist == "on")
    # 32 samples of 96 + 64 tokens split over DP 2: 3 micro-batches of 1024 per rank, so stage 0 keeps
    # PP = 2 of them in flight: 2 micro-batches x 2 layers x 1024 tokens x 1088 bytes.
    off, on = plan.activations_off_on
    assert off == 2 * 2 * 1024 * 1088
    # Recomputation keeps 2h = 128 bytes per token and layer, plus one layer's working set; the last
    # stage (1 micro-batch, + bf16 logits and their fp32 log-softmax: 1024 x 50 x 6) is the larger here.
    assert on == max(2 * 2 * 1024 * 128 + 1024 * 1088, 2 * 1024 * 128 + 1024 * 1088 + 1024 * 50 * 6)
    # vLLM's share: utilization x GPU memory = weights + 2 GiB reserve + KV cache.
    gen = plan.memory["generation"]
    budget = cfg.rollout.gpu_memory_utilization * GPUS["H100-80GB"].memory_gib * 1024**3
    assert gen["vLLM weights"] == total_params(SMALL) * 2
    assert gen["vLLM weights"] + gen["vLLM activations + non-torch (reserve)"] + gen["vLLM KV cache"] == pytest.approx(
        budget)
    assert plan.kv_tokens_per_engine == int(gen["vLLM KV cache"] // 512)


def test_time_model_relations():
    cfg = _cfg("algorithm.kl_coef=0.1")
    plan = make_plan(cfg, SMALL, PlanOptions(gpus_per_node=1, recompute="off"))
    # One reference forward; training is forward + backward = 3 forwards (4 with recomputation).
    assert plan.seconds["training"] == pytest.approx(3 * plan.seconds["logprobs"])
    recomputed = make_plan(cfg, SMALL, PlanOptions(gpus_per_node=1, recompute="on"))
    assert recomputed.seconds["training"] == pytest.approx(4 * plan.seconds["logprobs"])
    # A decode step reads the weights and the KV cache at 80% of HBM bandwidth, plus 2 ms of overhead.
    gpu = GPUS["H100-80GB"]
    expected = (total_params(SMALL) * 2 + 10 * 100 * 512) / (gpu.hbm_bytes_s * 0.8) + 2e-3
    assert decode_step_seconds(plan, cfg, 10, 100) == pytest.approx(expected)


def test_refuses_a_layout_that_is_not_the_allocation():
    cfg = _cfg("parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=2")
    with pytest.raises(PlanError, match=r"parallel.tensor_model_parallel_size .* = 2 x 1 x 2 = 4 GPUs does not "
                                        r"equal the allocation's 1 nodes x 8 GPUs = 8"):
        make_plan(cfg, SMALL, PlanOptions(nodes=1, gpus_per_node=8))
    with pytest.raises(ArchError, match="not divisible by TP=8"):
        make_plan(_cfg("parallel.tensor_model_parallel_size=8"), SMALL, PlanOptions(gpus_per_node=8))


def test_refuses_what_does_not_fit():
    seventy = MODEL_SHAPES["llama-3.1-70b"]
    one_node = _cfg("parallel.tensor_model_parallel_size=8", "rollout.tensor_parallel_size=8")
    with pytest.raises(PlanError, match=r"does not fit: the generation phase needs .* GiB per GPU > 79.6 GiB on "
                                        r"H100-80GB .*largest: optimizer.* parallel.tensor_model_parallel_size"):
        make_plan(one_node, seventy, PlanOptions(gpus_per_node=8))
    # Without recomputation the 70B recipe's 16k-token micro-batches do not fit on H100s.
    with pytest.raises(PlanError, match=r"training phase .*activations \(no recomputation\).*"
                                        r"trainer.micro_batch_tokens"):
        plan_config("configs/raro_70b.yaml", [], PlanOptions(recompute="off"), "llama-3.1-70b")
    with pytest.raises(PlanError, match="rollout.gpu_memory_utilization=0.05 .* no room for a KV cache"):
        plan_config("configs/raro_70b.yaml", ["rollout.gpu_memory_utilization=0.05"], PlanOptions(), "llama-3.1-70b")


def test_the_70b_recipe_fits_with_the_settings_auto_picks():
    plan = plan_config("configs/raro_70b.yaml", [], PlanOptions(nodes=8, gpus_per_node=8), "llama-3.1-70b")
    assert (plan.tp, plan.pp, plan.dp, plan.gpus, plan.engines) == (8, 4, 2, 64, 2)
    assert plan.distributed_optimizer and plan.recompute
    assert all(sum(lines.values()) < 79.6 * 1024**3 for lines in plan.memory.values())
    assert plan.kv_tokens_per_engine >= 12288
    assert set(plan.seconds) == {"generation", "logprobs", "training", "weight refit"}


def test_cli_prints_the_table_and_exits_2_on_refusal(capsys):
    assert main(["plan", "--model-shape", "llama-3.1-70b", "configs/raro_70b.yaml"]) == 0
    out = capsys.readouterr().out
    for text in ("memory per GPU (GiB)", "vLLM KV cache", "time per step (estimate)", "weight refit"):
        assert text in out
    assert main(["plan", "--model-shape", "llama-3.1-70b", "--nodes", "4", "configs/raro_70b.yaml"]) == 2
    err = capsys.readouterr().err
    assert "error: parallel.tensor_model_parallel_size" in err and "= 64 GPUs does not equal" in err
    assert main(["plan", "configs/raro_70b.yaml"]) == 2  # no weights at model.path and no --model-shape
    assert "--model-shape" in capsys.readouterr().err


def test_lora_trains_only_the_adapters():
    # rank 4 at TP 2 x PP 2 (2 layers per stage), per layer: qkv A 4x64 + B (64 + 2x32)x4 / 2; proj A 4x64 / 2
    # + B 64x4; fc1 A 4x64 + B 2x128x4 / 2; fc2 A 4x128 / 2 + B 64x4.
    per_layer = (256 + 256) + (128 + 256) + (256 + 512) + (256 + 256)
    assert lora_params_per_gpu(SMALL, 2, 2, 4, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]) == (
        2 * per_layer)
    assert lora_params_per_gpu(SMALL, 1, 1, 4, ["linear_qkv"]) == 4 * (256 + 512)
    base = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
            "parallel.data_parallel_size=2", "trainer.micro_batch_tokens=1024"]
    opt = PlanOptions(nodes=1, gpus_per_node=8, distributed_optimizer="off", recompute="off")
    full = make_plan(_cfg(*base), SMALL, opt)
    lora = make_plan(_cfg(*base, "lora.enabled=true", "lora.rank=4"), SMALL, opt)
    train = lora.memory["training"]
    assert train["parameters (bf16)"] == 2 * 40384  # the frozen base stays
    assert train["gradients (fp32) of the LoRA adapters"] == 4 * 2 * per_layer
    assert sum(v for k, v in train.items() if k.startswith("optimizer")) == 12 * 2 * per_layer
    assert train["LoRA adapters (fp32)"] == 4 * 2 * per_layer
    # no weight gradients of the base: 2 of the 3 forward-sized passes
    assert lora.seconds["training"] == pytest.approx(full.seconds["training"] * 2 / 3)
    # with a KL term the reference is the actor with its adapters off: no reference model in memory
    kl = ["algorithm.kl_coef=0.01"]
    assert "reference model (onloaded)" in make_plan(_cfg(*base, *kl), SMALL, opt).memory["logprobs"]
    assert "reference model (onloaded)" not in make_plan(_cfg(*base, *kl, "lora.enabled=true"), SMALL,
                                                         opt).memory["logprobs"]
