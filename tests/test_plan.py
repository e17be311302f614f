"""`megareason plan`: memory numbers against hand-computed values and measured bytes, the trainer's settings
read from the config, refusals naming the field and the fix, and the CLI's exit codes."""

from __future__ import annotations

import pytest

from megareason.cli import main
from megareason.config import load_config
from megareason.launch.plan import (
    GPUS,
    MODEL_SHAPES,
    PlanError,
    PlanOptions,
    decode_step_seconds,
    kv_bytes_per_token,
    make_plan,
    plan_config,
    workload,
)
from megareason.launch.plan_format import format_plan
from megareason.launch.plan_memory import (
    active_params,
    flop_params,
    layer_bytes,
    lora_params_per_gpu,
    memory_per_rank,
    params_per_gpu,
    stage_activations,
    stage_param_split,
    states,
    total_params,
)
from megareason.launch.plan_time import all_to_all_seconds, decode_read_params
from megareason.models.arch import ArchError, ModelArch

# 4 layers, hidden 64, ffn 128, 4 heads / 2 kv heads of 16, vocab 100, untied: small enough to count by hand.
SMALL = ModelArch(family="llama", vocab_size=100, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling_factor=0.0,
                  max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False)
# Per layer: q 64x64 + k,v 2 x 64x32 + o 64x64 = 12288, MLP 3 x 64x128 = 24576, two norms 2 x 64.
LAYER = 12288 + 24576
EMBEDDING = 100 * 64
N_TP2_PP2 = 40384  # parameters on a GPU of either stage at TP 2 x PP 2 (test_parameter_counts_by_hand)
GiB = 1024**3


def _cfg(*overrides: str):
    return load_config("grpo_smollm2_cpu", ["rollout.dtype=bfloat16", "rollout.enforce_eager=false", *overrides])


def _small_layout(*overrides: str):
    return _cfg("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                "parallel.data_parallel_size=2", "trainer.micro_batch_tokens=1024", *overrides)


def test_parameter_counts_by_hand():
    assert total_params(SMALL) == 4 * (LAYER + 128) + EMBEDDING + EMBEDDING + 64
    # TP 2 x PP 2: 2 layers per stage, linear weights halved, norms replicated; the last stage adds the
    # final norm and its half of the output layer (the first stage's half embedding is 64 smaller).
    assert params_per_gpu(SMALL, 2, 2) == 2 * (LAYER // 2 + 128) + EMBEDDING // 2 + 64 == N_TP2_PP2
    tied = ModelArch(**{**SMALL.__dict__, "tie_word_embeddings": True})
    assert params_per_gpu(tied, 1, 1) == total_params(SMALL) - EMBEDDING  # one shared matrix at PP = 1
    assert params_per_gpu(tied, 1, 2) == params_per_gpu(SMALL, 1, 2)  # the last stage keeps its own copy


def test_qwen3_shapes_match_their_model_cards():
    """Qwen3's published counts (model cards): 8B = 8.2B parameters, 6.95B without embeddings; 32B = 32.8B /
    31.2B; 0.6B = 0.6B / 0.44B (tied). head_dim is 128 though hidden / heads is 64 for the 0.6B."""
    for name, total, non_embedding in (("qwen3-8b", 8.2e9, 6.95e9), ("qwen3-32b", 32.8e9, 31.2e9),
                                       ("qwen3-0.6b", 0.6e9, 0.44e9)):
        arch = MODEL_SHAPES[name]
        embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
        assert total_params(arch) == pytest.approx(total, rel=0.01), name
        assert total_params(arch) - embeddings == pytest.approx(non_embedding, rel=0.01), name
    assert MODEL_SHAPES["qwen3-0.6b"].head_dim == 128 and MODEL_SHAPES["qwen3-0.6b"].qk_norm


def test_state_bytes_per_parameter_by_hand():
    n = N_TP2_PP2
    per_param = {}
    for precision in ("fp32", "bf16"):
        for dist in ("false", "true"):
            st = states(_small_layout(f"trainer.precision={precision}", f"optim.use_distributed_optimizer={dist}"),
                        SMALL, 2, 2, 2, stage=1)
            per_param[precision, dist] = sum(st.values()) / n
            assert st["gradients"] == 4 * n  # fp32 main_grad, whole on every DP rank
    # fp32: 4 params + 4 grads + 8 Adam moments; the distributed optimizer shards the moments over DP 2.
    assert per_param["fp32", "false"] == 16 and per_param["fp32", "true"] == 8 + 8 / 2
    # bf16: 2 params + 4 fp32 grads + 12 (fp32 main weights + moments), the 12 over DP: 6 + 12 / DP.
    assert per_param["bf16", "false"] == 18 and per_param["bf16", "true"] == 6 + 12 / 2
    # LoRA: the frozen base and the adapters in the model's precision; grads and optimizer of the adapters.
    lora = lora_params_per_gpu(SMALL, 2, 2, 8, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    st = states(_small_layout("trainer.precision=bf16", "lora.enabled=true"), SMALL, 2, 2, 2, stage=1)
    assert st == {"parameters": 2 * (n + lora), "gradients": 4 * lora, "optimizer_state": 12 * lora}


def test_activation_bytes_by_hand():
    # TE layers, bf16, TP 2 (2 heads, q = 32, k = 16, f = 64 per rank), per token: norms 2 x (2h·2 + 4) = 520,
    # RoPE 4d·2 = 128, attention (3q + 3k)·2 + 4 x 2 heads = 296, MLP 5f·2 = 640.
    t = 1024
    bf16 = _small_layout("trainer.precision=bf16")
    assert layer_bytes(bf16, SMALL, 2, t, "te") == (520 + 128 + 296 + 640) * t
    # Sequence parallelism halves the norms; selective recomputation drops the softmax statistics.
    assert layer_bytes(_small_layout("trainer.precision=bf16", "parallel.sequence_parallel=true"), SMALL, 2, t,
                       "te") == (260 + 128 + 296 + 640) * t
    assert layer_bytes(_small_layout("trainer.precision=bf16", "trainer.recompute=selective"), SMALL, 2, t,
                       "te") == (520 + 128 + 288 + 640) * t
    # Local layers: torch's RMSNorm keeps fp32 copies, 2 x ((8 + 2)h + 4) = 1288; q, k and v repeated to
    # every head + the context 4q·2 = 256; per layer the T x T softmax (fp32 + bf16) of 2 heads.
    assert layer_bytes(bf16, SMALL, 2, t, "local") == (1288 + 128 + 256 + 640) * t + 2 * t * t * 6
    # Stages, one micro-batch: 2 layers; the first adds token ids and the embedding's mask (9 per token),
    # the last the final norm (260 per token), the head's fp32 probabilities and log-probs (8 x 50 + 13)
    # and its sequence-start mask (1); local layers add the packed row's T x T mask once.
    layer = 1584 * t
    assert stage_activations(bf16, SMALL, 2, 2, t, 0).saved == 2 * layer + 9 * t
    assert stage_activations(bf16, SMALL, 2, 2, t, 1).saved == 2 * layer + 260 * t + 414 * t
    local = layer_bytes(bf16, SMALL, 2, t, "local")
    assert stage_activations(bf16, SMALL, 2, 2, t, 0, spec="local").saved == 2 * local + t * t + 9 * t
    # Full recomputation: each layer keeps its input (h·2 per token), the stage the fp32 rotary table once
    # (4d); one layer's activations while it reruns.
    full = stage_activations(_small_layout("trainer.precision=bf16", "trainer.recompute=full"), SMALL, 2, 2, t, 0)
    assert (full.saved, full.working) == (2 * 128 * t + 64 * t + 9 * t, layer)
    one = stage_activations(_small_layout("trainer.precision=bf16", "trainer.recompute=full",
                                          "trainer.recompute_num_layers=1"), SMALL, 2, 2, t, 0)
    assert (one.saved, one.working) == (128 * t + 64 * t + layer + 9 * t, layer)


# Bytes measured on CPU (megatron-core 0.16.1, torch 2.13, local layers, gloo): a Llama of hidden 128, ffn 256,
# 2 layers, 4 heads / 2 kv heads, vocab 384, one packed row of 16 tokens (TrainBatch with cu_seqlens, run by
# models.schedule), models.memory.SavedActivations around its forward and log-prob head (15 scored positions)
# and models.memory.state_bytes.
MEASURED = [  # (overrides, TP, activations)
    (["trainer.precision=fp32"], 1, 423827),
    (["trainer.precision=bf16"], 1, 284563),
    (["trainer.precision=bf16", "trainer.recompute=full"], 1, 77459),
    (["trainer.precision=fp32", "trainer.recompute=full", "trainer.recompute_num_layers=1"], 1, 257811),
    (["trainer.precision=bf16", "parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=2"], 2,
     146691),
    (["trainer.precision=fp32", "parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=2",
      "trainer.recompute=full"], 2, 46211),
]


@pytest.mark.parametrize(("overrides", "tp", "measured"), MEASURED)
def test_memory_per_rank_equals_measured_bytes(overrides, tp, measured):
    tiny = ModelArch(family="llama", vocab_size=384, hidden_size=128, ffn_hidden_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                     rope_scaling_factor=0.0, max_position_embeddings=1024, tie_word_embeddings=False, qkv_bias=False)
    mem = memory_per_rank(_cfg(*overrides), tiny, tp, 1, 1, 16, spec="local", scored_tokens=15)
    assert mem["activations"] == measured
    n = 2 * (3 * 128 * 128 + 3 * 128 * 256) // tp + 2 * 2 * 128 + 128 + 2 * 384 * 128 // tp  # measured too
    assert mem["parameters"] == n * (4 if "trainer.precision=fp32" in overrides else 2)
    assert mem["gradients"] == 4 * n


def test_kv_bytes_by_hand():
    # K and V, 4 layers, 2 kv heads of 16, bf16; with vLLM TP 4 each GPU keeps one (replicated) kv head.
    assert kv_bytes_per_token(SMALL, 1, 2) == 2 * 4 * 2 * 16 * 2 == 512
    assert kv_bytes_per_token(SMALL, 2, 2) == kv_bytes_per_token(SMALL, 4, 2) == 256


def test_memory_lines_of_a_small_plan():
    n = N_TP2_PP2 - 64  # training peaks on the first stage (activations), whose half embedding is 64 smaller
    for dist, optimizer in (("false", 12 * n), ("true", 12 * n // 2)):
        cfg = _small_layout("trainer.precision=bf16", f"optim.use_distributed_optimizer={dist}")
        plan = make_plan(cfg, SMALL, PlanOptions(nodes=1, gpus_per_node=8))
        train = plan.memory["training"]
        assert train["parameters (bf16)"] == 2 * n
        assert train["gradients (fp32 main_grad)"] == 4 * n
        assert sum(v for k, v in train.items() if k.startswith("optimizer")) == optimizer
        assert plan.settings["optim.use_distributed_optimizer"] == (dist == "true")
    # 32 samples of 96 + 64 tokens over DP 2: 3 micro-batches of 1024 per rank, so stage 0 keeps PP = 2 of
    # them in flight (test_activation_bytes_by_hand: 2 layers x 1584 + 9 bytes per token each).
    t = 1024
    assert plan.stages["training"] == 0
    assert train["activations (no recompute, 2 in flight)"] == 2 * (2 * 1584 + 9) * t
    assert plan.activations_by_recompute["none"] == 2 * (2 * 1584 + 9) * t
    # Full recomputation: the last stage (1 in flight, + final norm and head) is now the larger.
    full = 2 * 128 * t + 64 * t
    assert plan.activations_by_recompute["full"] == full + (260 + 414) * t + 1584 * t
    # vLLM's share: utilization x cudaMemGetInfo's total = weights + 2 GiB reserve (its activation peak and what
    # it keeps asleep) + KV cache; beside the trainer's states (no offload: the Adam moments too, after a step).
    gen = plan.memory["generation"]
    budget = cfg.rollout.gpu_memory_utilization * GPUS["H100-80GB"].cuda_total_gib * GiB
    assert gen["vLLM weights"] == total_params(SMALL) * 2
    share = ("vLLM weights", "vLLM activation peak (profiled)", "vLLM CUDA graphs + buffers (kept while asleep)",
             "vLLM KV cache")
    assert sum(gen[k] for k in share) == pytest.approx(budget)
    assert plan.kv_tokens_per_engine == int(gen["vLLM KV cache"] // 512)
    # TP 2 x PP 2 x DP 2: the world, TP, DP, PP and embedding groups' communicators, 0.25 GiB each; the
    # process's memory outside torch's allocator, as measured on an H200; at vLLM TP 1 no communicator of vLLM's.
    assert gen["NCCL communicators: 5 of Megatron's (NVLS off)"] == 5 * 0.25 * GiB
    assert gen["outside torch's allocator: CUDA context, cuBLAS, NCCL (measured)"] == 9_576_448_000
    assert plan.vllm_tp == 1 and "vLLM's NCCL communicator" not in gen
    assert "optimizer: Adam moments (/ DP 2)" in gen
    # Start-up: the engine starts beside the built trainer, whose Adam moments come with the first step.
    start = plan.memory["start-up"]
    assert start == {k: v for k, v in gen.items() if k != "optimizer: Adam moments (/ DP 2)"}
    # The save: gradient buffers emptied, the engine asleep (its weights in host memory, what it keeps asleep
    # on the device), the distributed optimizer's all-gather of each state into a list (+ PyTorch's flat copy)
    # over the stage's trained parameters: 4·n·(2 + 1/DP).
    save = plan.memory["save"]
    n_save = sum(stage_param_split(SMALL, 2, 2, plan.stages["save"]))
    assert "gradients (fp32 main_grad)" not in save
    assert save["checkpoint save: distributed optimizer's gather buffers"] == int(4 * n_save * 2.5)
    assert save["vLLM CUDA graphs + buffers (kept while asleep)"] == 1.0 * GiB
    assert "vLLM KV cache" not in save and "vLLM weights" not in save
    # The resume loads with the engine asleep; its sync then wakes it: the peak is the step's generation.
    assert plan.memory["resume"] == gen
    # trainer.offload_optimizer: the gradients and optimizer state leave the GPU while vLLM is awake, from the
    # start (before the engine starts) and before every wake-up.
    offloaded = make_plan(_small_layout("trainer.precision=bf16", "optim.use_distributed_optimizer=true",
                                        "trainer.offload_optimizer=true"), SMALL, PlanOptions(nodes=1, gpus_per_node=8))
    for phase in ("start-up", "generation", "sync"):
        lines = offloaded.memory[phase]
        assert not any(k.startswith(("gradients", "optimizer")) for k in lines), lines
    n_gen = sum(stage_param_split(SMALL, 2, 2, plan.stages["generation"]))
    assert offloaded.stages["generation"] == plan.stages["generation"]
    assert sum(plan.memory["generation"].values()) - sum(offloaded.memory["generation"].values()) == (
        4 * n_gen + 12 * n_gen // 2)
    assert offloaded.memory["training"] == plan.memory["training"]


def test_gpu_recipes_fit_every_phase_with_five_gib_free():
    """The 70B RARO recipe, Qwen3-8B and Qwen3-30B-A3B leave >= 5 GiB of cudaMemGetInfo's total free in every
    phase, the checkpoint save included."""
    for config, shape, nodes in (("raro_70b", "llama-3.1-70b", 8), ("grpo_qwen3_8b", "qwen3-8b", 1),
                                 ("grpo_qwen3_30b_a3b", "qwen3-30b-a3b", 4)):
        plan = plan_config(config, [], PlanOptions(nodes=nodes), model_shape=shape)
        for phase, lines in plan.memory.items():
            free = plan.gpu.cuda_total_gib * GiB - sum(lines.values())
            assert free >= 5 * GiB, (config, phase, free / GiB)


def test_time_model_relations():
    cfg = _cfg("algorithm.kl_coef=0.1", "trainer.precision=bf16")
    plan = make_plan(cfg, SMALL, PlanOptions(gpus_per_node=1))
    # One reference forward; training is forward + backward = 3 forwards (4 with full recomputation).
    assert plan.seconds["training"] == pytest.approx(3 * plan.seconds["logprobs"])
    recomputed = make_plan(_cfg("algorithm.kl_coef=0.1", "trainer.precision=bf16", "trainer.recompute=full"), SMALL,
                           PlanOptions(gpus_per_node=1))
    assert recomputed.seconds["training"] == pytest.approx(4 * plan.seconds["logprobs"])
    # fp32 runs at the fp32 peak (no TF32), not the tensor cores'.
    fp32 = make_plan(_cfg("algorithm.kl_coef=0.1"), SMALL, PlanOptions(gpus_per_node=1))
    gpu = GPUS["H100-80GB"]
    assert fp32.seconds["training"] == pytest.approx(plan.seconds["training"] * gpu.bf16_flops / gpu.fp32_flops)
    # A decode step reads the weights and the KV cache at 80% of HBM bandwidth, plus 2 ms of overhead.
    expected = (total_params(SMALL) * 2 + 10 * 100 * 512) / (gpu.hbm_bytes_s * 0.8) + 2e-3
    assert decode_step_seconds(plan, cfg, 10, 100) == pytest.approx(expected)
    # The mean response length in tokens instead of a fraction of max_tokens.
    assert workload(cfg, PlanOptions(response_tokens=40))[0].response == 40
    assert workload(cfg, PlanOptions())[0].response == 0.5 * cfg.rollout.max_tokens


def test_refuses_a_layout_that_is_not_the_allocation():
    cfg = _cfg("parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=2")
    with pytest.raises(PlanError, match=r"parallel.tensor_model_parallel_size .* = 2 x 1 x 2 = 4 GPUs does not "
                                        r"equal the allocation's 1 nodes x 8 GPUs = 8"):
        make_plan(cfg, SMALL, PlanOptions(nodes=1, gpus_per_node=8))
    with pytest.raises(ArchError, match="not divisible by TP=8"):
        make_plan(_cfg("parallel.tensor_model_parallel_size=8"), SMALL, PlanOptions(gpus_per_node=8))
    with pytest.raises(PlanError, match="trainer.recompute_num_layers=3 is more than the 2 layers"):
        make_plan(_small_layout("trainer.recompute=full", "trainer.recompute_num_layers=3"), SMALL,
                  PlanOptions(nodes=1, gpus_per_node=8))


def _plan_70b(*overrides: str):
    return plan_config("configs/raro_70b.yaml", list(overrides), PlanOptions(nodes=8, gpus_per_node=8),
                       "llama-3.1-70b")


def test_the_70b_recipe_plans_its_own_settings():
    plan = _plan_70b()
    # rollout TP 8: one colocated SPMD engine per 8 consecutive ranks, every GPU generates
    assert (plan.tp, plan.pp, plan.dp, plan.gpus, plan.engines, plan.spec) == (8, 4, 2, 64, 8, "te")
    assert plan.settings == {"trainer.precision": "bf16", "optim.use_distributed_optimizer": True,
                             "trainer.recompute": "full", "trainer.recompute_num_layers": 10,
                             "parallel.sequence_parallel": True, "trainer.offload_optimizer": True}
    assert all(sum(lines.values()) < 79.6 * GiB for lines in plan.memory.values())
    assert plan.kv_tokens_per_engine >= 12288
    assert set(plan.seconds) == {"generation", "logprobs", "training", "weight refit"}


def test_the_qwen3_8b_recipe_fits_one_node_and_needs_its_distributed_optimizer():
    plan = plan_config("configs/grpo_qwen3_8b.yaml", [], PlanOptions(gpus_per_node=8), "qwen3-8b")
    assert (plan.tp, plan.pp, plan.dp, plan.gpus, plan.engines) == (2, 1, 4, 8, 4)
    assert all(sum(lines.values()) < 79.6 * GiB for lines in plan.memory.values())
    with pytest.raises(PlanError, match="set optim.use_distributed_optimizer=true to make it fit"):
        plan_config("configs/grpo_qwen3_8b.yaml", ["optim.use_distributed_optimizer=false"],
                    PlanOptions(gpus_per_node=8), "qwen3-8b")


@pytest.mark.parametrize(("override", "fix"), [
    ("optim.use_distributed_optimizer=false", "set optim.use_distributed_optimizer=true to make it fit"),
    ("trainer.recompute=none", "set trainer.recompute=full trainer.recompute_num_layers=10 to make it fit"),
    ("parallel.sequence_parallel=false", "set parallel.sequence_parallel=true to make it fit"),
    ("trainer.precision=fp32", "set trainer.precision=bf16 to make it fit"),
])
def test_the_70b_recipe_needs_each_of_its_settings(override, fix):
    # Turning one off is refused, naming the setting in the plan and the change that makes it fit again.
    with pytest.raises(PlanError, match="does not fit") as refused:
        _plan_70b(override)
    assert override in str(refused.value) and fix in str(refused.value)


def test_refuses_what_no_setting_makes_fit():
    seventy = MODEL_SHAPES["llama-3.1-70b"]
    one_node = _cfg("parallel.tensor_model_parallel_size=8", "rollout.tensor_parallel_size=8")
    with pytest.raises(PlanError, match=r"does not fit: the start-up phase needs .* GiB per GPU > 74.2 GiB "
                                        r"\(cudaMemGetInfo's 79.19 GiB on H100-80GB less a 5 GiB margin\).*largest: "
                                        r"parameters.*no change of trainer.precision.* makes it fit: split the model "
                                        r"over more GPUs"):
        make_plan(one_node, seventy, PlanOptions(gpus_per_node=8))
    with pytest.raises(PlanError, match="rollout.gpu_memory_utilization=0.05 .* no room for a KV cache"):
        _plan_70b("rollout.gpu_memory_utilization=0.05")


def test_cli_prints_the_table_and_exits_2_on_refusal(capsys):
    assert main(["plan", "--model-shape", "llama-3.1-70b", "configs/raro_70b.yaml"]) == 0
    out = capsys.readouterr().out
    for text in ("memory per GPU (GiB)", "vLLM KV cache", "time per step (estimate)", "weight refit",
                 "settings (from the config): trainer.precision=bf16 optim.use_distributed_optimizer=true "
                 "trainer.recompute=full trainer.recompute_num_layers=10 parallel.sequence_parallel=true"):
        assert text in out
    assumed = next(line for line in out.splitlines() if line.startswith("assumed:"))
    assert "distributed" not in assumed and "recompute" not in assumed and "bf16" not in assumed
    assert main(["plan", "--model-shape", "llama-3.1-70b", "configs/raro_70b.yaml", "trainer.recompute=none"]) == 2
    assert "with trainer.precision=bf16 optim.use_distributed_optimizer=true trainer.recompute=none" in (
        capsys.readouterr().err)
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
    full = make_plan(_small_layout(), SMALL, PlanOptions(nodes=1, gpus_per_node=8))
    lora = make_plan(_small_layout("lora.enabled=true", "lora.rank=4"), SMALL, PlanOptions(nodes=1, gpus_per_node=8))
    assert lora.spec == "local"  # LoRA builds megatron-core's local layers (models/roles.py)
    train, a = lora.memory["training"], 2 * per_layer
    assert train["parameters (fp32, base + LoRA adapters)"] == 4 * (N_TP2_PP2 - 64 + a)  # the frozen base stays
    assert train["gradients (fp32 main_grad of the LoRA adapters)"] == 4 * a
    assert sum(v for k, v in train.items() if k.startswith("optimizer")) == 8 * a
    # no weight gradients of the base: 2 of the 3 forward-sized passes
    assert lora.seconds["training"] == pytest.approx(full.seconds["training"] * 2 / 3)
    # with a KL term the reference is the actor with its adapters off: no reference model in memory
    kl = "algorithm.kl_coef=0.01"
    opt = PlanOptions(nodes=1, gpus_per_node=8)
    assert "reference model (onloaded)" in make_plan(_small_layout(kl), SMALL, opt).memory["logprobs"]
    assert "reference model (onloaded)" not in make_plan(_small_layout(kl, "lora.enabled=true"), SMALL,
                                                         opt).memory["logprobs"]


def test_rollout_engines_follow_the_trainer_placement():
    from megareason.launch.plan import rollout_engines

    assert rollout_engines(64, 8, 2) == 8  # colocated SPMD engines: every GPU generates
    assert rollout_engines(64, 1, 2) == 2  # rollout TP 1: one engine per data-parallel replica
    plan = _plan_70b()
    assert plan.engines * plan.vllm_tp == plan.gpus
    assert plan.notes["weight refit"].startswith("141 GB to every rank, in-process")


# ----------------------------------------------------------------------------------------- mixtures of experts

# SMALL's attention (hidden 64, 4 heads / 2 kv heads of 16, vocab 100, untied) in 2 layers whose MLP is 4 SwiGLU
# experts of ffn 32, top-2 (Mixtral's router: softmax over the chosen two).
MOE = ModelArch(**{**SMALL.__dict__, "family": "mixtral", "ffn_hidden_size": 32, "num_layers": 2, "num_experts": 4,
                   "moe_top_k": 2, "moe_ffn_hidden_size": 32})
# Per layer: attention 12288, two norms 128, the router 4 x 64 = 256 (replicated over TP); an expert 3 x 64 x 32.
MOE_DENSE_LAYER, EXPERT = 12288 + 128 + 256, 6144


def _moe_layout(*overrides: str):
    """TP 2 x DP 2 (sequence parallel: an MoE at TP > 1 needs it), bf16, the distributed optimizer."""
    return _cfg("parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=2",
                "parallel.sequence_parallel=true", "trainer.precision=bf16", "optim.use_distributed_optimizer=true",
                "trainer.micro_batch_tokens=1024", *overrides)


def test_moe_total_and_active_counts_by_hand():
    embeddings = 2 * EMBEDDING + 64  # input and output embeddings (untied) + the final norm
    assert total_params(MOE) == 2 * (MOE_DENSE_LAYER + 4 * EXPERT) + embeddings == MOE.param_counts()[0]
    assert active_params(MOE) == 2 * (MOE_DENSE_LAYER + 2 * EXPERT) + embeddings == MOE.param_counts()[1]
    assert flop_params(MOE) == active_params(MOE) - EMBEDDING  # the input embedding is a lookup
    assert active_params(SMALL) == total_params(SMALL)  # dense: every parameter runs
    # Dense parts over TP (the router and norms replicated); each EP rank holds 4 / EP experts, each over TP.
    dense_tp2 = 2 * (12288 // 2 + 128 + 256) + EMBEDDING // 2
    assert stage_param_split(MOE, 2, 1, 0, ep=1) == (dense_tp2 + EMBEDDING // 2 + 64, 2 * 4 * EXPERT // 2)
    assert stage_param_split(MOE, 2, 1, 0, ep=2) == (dense_tp2 + EMBEDDING // 2 + 64, 2 * 2 * EXPERT // 2)


@pytest.mark.parametrize(("name", "total", "active"), [("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                                       ("mixtral-8x7b", 46.7e9, 12.9e9)])
def test_moe_shapes_match_their_published_counts(name, total, active):
    arch = MODEL_SHAPES[name]
    assert arch.is_moe and (total_params(arch), active_params(arch)) == arch.param_counts()
    assert total_params(arch) == pytest.approx(total, rel=0.02)
    assert active_params(arch) == pytest.approx(active, rel=0.02)


def test_moe_state_bytes_at_ep_1_and_2_by_hand():
    """Expert weights (and their gradients) halve from EP 1 to EP 2, dense ones do not; the distributed
    optimizer shards the dense state over DP 4 and the experts' over DP / EP, so each GPU keeps 12·E / DP
    bytes of expert state at any EP (E / EP experts over DP / EP ranks)."""
    dense, experts = 2 * (12288 // 2 + 128 + 256) + EMBEDDING + 64, 2 * 4 * EXPERT // 2  # TP 2, PP 1
    cfg = _moe_layout("parallel.data_parallel_size=4")
    for ep in (1, 2):
        st = states(cfg, MOE, 2, 1, 4, 0, ep)
        assert st["parameters"] == 2 * (dense + experts // ep)
        assert st["gradients"] == 4 * (dense + experts // ep)
        assert st["optimizer_state"] == 12 * dense // 4 + 12 * (experts // ep) // (4 // ep)
    assert memory_per_rank(cfg, MOE, 2, 1, 4, 1024, ep=2)["parameters"] == 2 * (dense + experts // 2)
    plain = _moe_layout("parallel.data_parallel_size=4", "optim.use_distributed_optimizer=false")
    assert states(plain, MOE, 2, 1, 4, 0, 2)["optimizer_state"] == 12 * (dense + experts // 2)


def test_moe_activations_use_the_active_experts():
    # TE, bf16, TP 1, per token: norms 2 x (2h·2 + 4) = 520, RoPE 4d·2 = 128, attention (3q + 3k)·2 + 4a =
    # (192 + 96)·2 + 16 = 592; MLP: the top-2 experts' 5f·2 = 320 each, their dispatched inputs and weighted
    # outputs 2h·2 = 256 each, the router's fp32 logits and probabilities 8 x 4 experts = 32.
    t = 1024
    assert layer_bytes(_cfg("trainer.precision=bf16"), MOE, 1, t, "te") == (520 + 128 + 592 + 2 * (320 + 256) + 32) * t
    # At TP 2 with sequence parallelism: norms and the router over T / 2 tokens, each expert's f over TP.
    sp = _moe_layout()
    assert layer_bytes(sp, MOE, 2, t, "te") == (260 + 128 + 296 + 2 * (160 + 256)) * t + 32 * t // 2
    # Whatever EP is: with balanced routing each rank's experts see k copies of its tokens.
    assert stage_activations(sp, MOE, 2, 1, t, 0).saved == memory_per_rank(sp, MOE, 2, 1, 2, t, ep=2)["activations"]


def test_moe_plan_splits_the_experts_over_ep():
    opt = PlanOptions(nodes=1, gpus_per_node=4)
    one, two = (make_plan(_moe_layout(f"parallel.expert_model_parallel_size={ep}"), MOE, opt) for ep in (1, 2))
    dense, experts = 2 * (12288 // 2 + 128 + 256) + EMBEDDING + 64, 2 * 4 * EXPERT // 2
    assert one.memory["training"]["parameters (bf16)"] == 2 * (dense + experts)
    assert two.memory["training"]["parameters (bf16)"] == 2 * (dense + experts // 2)
    assert (two.ep, two.params_per_gpu, two.total_params, two.active_params) == (
        2, dense + experts // 2, total_params(MOE), active_params(MOE))
    assert two.memory["generation"]["vLLM weights"] == total_params(MOE) * 2  # vLLM holds every expert
    # Same FLOPs (active parameters); EP 2 adds the dispatch's all-to-alls.
    assert all_to_all_seconds(one, _moe_layout(), 1e6) == 0 < all_to_all_seconds(two, _moe_layout(), 1e6)
    text = format_plan(two)
    assert "TP 2 x PP 1 x DP 2, EP 2 (2 experts per GPU, expert DP 1)" in text
    assert f"{total_params(MOE) / 1e9:.2f}B parameters total, {active_params(MOE) / 1e9:.2f}B active per token" in text
    # A decode step of one sequence reads the dense weights and its top-2 experts of each layer; a large
    # batch reads them all.
    assert decode_read_params(MOE, 1) == pytest.approx(active_params(MOE))
    assert decode_read_params(MOE, 1000) == pytest.approx(total_params(MOE))


def test_moe_layouts_that_are_refused():
    opt2, opt4 = PlanOptions(nodes=1, gpus_per_node=2), PlanOptions(nodes=1, gpus_per_node=4)
    with pytest.raises(ArchError, match=r"expert_model_parallel_size=2 needs a mixture-of-experts model \(this one "
                                        r"is dense\)"):
        make_plan(_cfg("parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2"), SMALL, opt2)
    with pytest.raises(ArchError, match="num_experts=4 is not divisible by EP=8"):
        make_plan(_cfg("parallel.data_parallel_size=8", "parallel.expert_model_parallel_size=8"), MOE,
                  PlanOptions(nodes=1, gpus_per_node=8))
    with pytest.raises(PlanError, match=r"parallel.expert_model_parallel_size=4 does not divide "
                                        r"parallel.data_parallel_size=2"):
        make_plan(_moe_layout("parallel.expert_model_parallel_size=4"), MOE, opt4)
    with pytest.raises(PlanError, match=r"parallel.sequence_parallel=false: a mixture-of-experts model at "
                                        r"parallel.tensor_model_parallel_size=2 needs parallel.sequence_parallel=true"):
        make_plan(_moe_layout("parallel.sequence_parallel=false"), MOE, opt4)
    with pytest.raises(PlanError, match="lora.enabled=true: the planner does not count LoRA adapters"):
        make_plan(_moe_layout("lora.enabled=true"), MOE, opt4)


def test_the_qwen3_30b_a3b_recipe_fits_four_nodes_with_ep_8():
    plan = plan_config("configs/grpo_qwen3_30b_a3b.yaml", [], PlanOptions(gpus_per_node=8), "qwen3-30b-a3b")
    assert (plan.tp, plan.pp, plan.dp, plan.ep, plan.gpus, plan.engines, plan.vllm_tp) == (2, 1, 16, 8, 32, 16, 2)
    assert plan.settings["parallel.sequence_parallel"] and plan.settings["optim.use_distributed_optimizer"]
    assert all(sum(lines.values()) < 79.6 * GiB for lines in plan.memory.values())
    assert plan.kv_tokens_per_engine >= 5120
    assert "MoE: N = 3.35B active of 30.53B" in plan.notes["training"]
    # Without expert parallelism every GPU holds all 128 experts: no memory setting makes that fit.
    with pytest.raises(PlanError, match="does not fit.*split the model over more GPUs: .*expert_model_parallel_size"):
        plan_config("configs/grpo_qwen3_30b_a3b.yaml", ["parallel.expert_model_parallel_size=1"],
                    PlanOptions(gpus_per_node=8), "qwen3-30b-a3b")


# ----------------------------------------------------------------------------------------- separate engines, staleness

ONE_NODE, TWO_NODES = PlanOptions(nodes=1, gpus_per_node=8), PlanOptions(nodes=2, gpus_per_node=4)
BUCKET = "weight sync: a received bucket (beside vLLM's share)"


def _trainer_tp2_dp2(*overrides: str):
    """Megatron TP 2 x DP 2 (4 GPUs), vLLM TP 2, bf16, a reference model (kl_coef > 0)."""
    return _cfg("parallel.tensor_model_parallel_size=2", "parallel.data_parallel_size=2",
                "rollout.tensor_parallel_size=2", "trainer.precision=bf16", "trainer.micro_batch_tokens=1024",
                "algorithm.kl_coef=0.1", *overrides)


def _separate(*overrides: str):
    """The trainer on 4 GPUs, 2 engines x vLLM TP 2 on 4 GPUs of their own (8 in all)."""
    return _trainer_tp2_dp2("rollout.placement=separate", "rollout.num_engines=2", *overrides)


def test_the_separate_layout_splits_the_gpus_and_their_memory():
    cfg = _separate()
    plan = make_plan(cfg, SMALL, ONE_NODE)
    assert (plan.gpus, plan.trainer_gpus, plan.engine_gpus, plan.engines, plan.vllm_tp) == (8, 4, 4, 2, 2)
    # An engine's GPU holds vLLM alone: its weights at vLLM TP 2, the reserve, the KV cache (the rest of
    # gpu_memory_utilization x 79.6 GiB), and the weight sync's bucket in flight beside them.
    gen = plan.memory["generation"]
    assert set(gen) == {"vLLM weights", "vLLM activations + non-torch (reserve)", "vLLM KV cache", BUCKET}
    assert gen["vLLM weights"] == total_params(SMALL) * 2 // 2
    assert gen["vLLM weights"] + gen["vLLM activations + non-torch (reserve)"] + gen["vLLM KV cache"] == pytest.approx(
        cfg.rollout.gpu_memory_utilization * 79.19 * GiB)
    assert gen[BUCKET] == cfg.trainer.weight_sync_bucket_mb * 2**20
    # The trainer's GPUs hold no vLLM in any state (nothing sleeps or wakes): the same bytes as a colocated
    # trainer of that layout, less what vLLM keeps asleep on the device, in training and at the save; its sync
    # peaks with the gathered tensors (a colocated one once the KV cache is awake again).
    colocated = make_plan(_trainer_tp2_dp2(), SMALL, PlanOptions(nodes=1, gpus_per_node=4))
    assert colocated.engines == 2 and colocated.memory["sync"]["vLLM weights"] > 0
    for phase in ("start-up", "resume", "sync", "training", "save"):
        assert not any(line.startswith("vLLM") or line == BUCKET for line in plan.memory[phase])
    for phase in ("training", "save"):
        assert plan.memory[phase] == {k: v for k, v in colocated.memory[phase].items() if not k.startswith("vLLM")}
    assert "weight sync: largest tensor gathered (x2: shards + whole) + bucket" in plan.memory["sync"]
    text = format_plan(plan)
    assert "= 8 GPUs (4 trainer + 4 engine)" in text and "2 engine(s) x TP 2 on 4 GPUs of their own" in text


def test_the_separate_layout_trains_on_its_gpus_and_refits_through_host_memory_or_the_network():
    sep, gpu = make_plan(_separate(), SMALL, ONE_NODE), GPUS["H100-80GB"]
    colocated = make_plan(_trainer_tp2_dp2(), SMALL, PlanOptions(nodes=1, gpus_per_node=4))
    # FLOPs over the 4 trainer GPUs, not the 8 of the job; the same 2 engines x TP 2 with the same KV cache.
    for phase in ("generation", "logprobs", "training"):
        assert sep.seconds[phase] == pytest.approx(colocated.seconds[phase])
    # One node, as the runtime does it: the first rank gathers the other TP rank's half over NVLink, copies
    # the bucket (the whole bf16 model: one 256 MB bucket, 10 ms of RPC) into shared memory at 20 GB/s, and each of
    # the 4 engine GPUs copies it out at 20 GB/s (4 reads x size < 200 GB/s of host memory).
    size = total_params(SMALL) * 2
    assert sep.seconds["weight refit"] == pytest.approx(size / 2 / (gpu.nvlink_bytes_s * 0.8) + 2 * size / 20e9
                                                        + 0.01)
    assert "through shared memory" in sep.notes["weight refit"] and not format_plan(sep).count("note: the runtime")
    # Two nodes (engines on the other one): the gather to the first rank over NVLink, then an NCCL broadcast
    # at each receiving GPU's NIC (50 GB/s at 80%); under the default shm transfer the plan says to set
    # rollout.weight_transfer=broadcast, which it plans, and says nothing once it is set.
    two = make_plan(_separate(), SMALL, TWO_NODES)
    assert two.seconds["weight refit"] == pytest.approx(size / 2 / (gpu.nvlink_bytes_s * 0.8)
                                                        + size / (gpu.network_bytes_s * 0.8) + 0.01)
    assert "NCCL broadcast (40 GB/s per receiving GPU, the network)" in two.notes["weight refit"]
    assert "set rollout.weight_transfer=broadcast" in format_plan(two)
    bcast = make_plan(_separate("rollout.weight_transfer=broadcast"), SMALL, TWO_NODES)
    assert bcast.seconds["weight refit"] == two.seconds["weight refit"]
    assert "note: rollout.weight_transfer" not in format_plan(bcast)


def test_step_time_is_the_sum_or_refit_plus_the_max():
    from megareason.launch.plan_records import step_seconds

    seconds = {"generation": 30.0, "logprobs": 5.0, "training": 20.0, "weight refit": 2.0}
    assert step_seconds(seconds, 0) == 30 + 5 + 20 + 2 == 57
    assert step_seconds(seconds, 1) == 2 + max(30, 5 + 20) == 32  # generation-bound
    seconds["generation"] = 10.0
    assert (step_seconds(seconds, 0), step_seconds(seconds, 1)) == (37, 2 + 25)  # trainer-bound
    off = make_plan(_separate("trainer.max_staleness=1"), SMALL, ONE_NODE)
    s = off.seconds
    assert off.step_seconds == off.off_policy_seconds == pytest.approx(
        s["weight refit"] + max(s["generation"], s["logprobs"] + s["training"]))
    assert off.sync_seconds == pytest.approx(sum(s.values()))
    assert off.sync_seconds > off.step_seconds
    on = make_plan(_separate(), SMALL, ONE_NODE)
    assert on.step_seconds == on.sync_seconds and on.seconds == off.seconds
    text = format_plan(off)
    assert "step, one step off" in text and "<- this config (trainer.max_staleness=1)" in text
    assert f"step = {s['weight refit']:.1f} + max({s['generation']:.1f}," in text


def test_the_separate_layout_refusals_name_the_fields():
    with pytest.raises(PlanError, match=r"rollout.placement=separate: parallel.tensor_model_parallel_size x "
                                        r"pipeline_model_parallel_size x data_parallel_size = 2 x 1 x 2 = 4 trainer "
                                        r"GPUs \+ rollout.num_engines x rollout.tensor_parallel_size = 3 x 2 = 6 "
                                        r"engine GPUs = 10 GPUs does not equal the allocation's 1 nodes x 8 GPUs = 8"):
        make_plan(_separate("rollout.num_engines=3"), SMALL, ONE_NODE)
    with pytest.raises(PlanError, match=r"= 10 GPUs does not equal the allocation's 2 nodes x 8 GPUs = 16"):
        make_plan(_separate("rollout.num_engines=3"), SMALL, PlanOptions(gpus_per_node=8))  # nodes from the layout
    # An engine of its own may be wider than a trainer replica; a colocated one may not.
    assert make_plan(_separate("rollout.num_engines=1", "rollout.tensor_parallel_size=4"), SMALL, ONE_NODE).vllm_tp == 4
    with pytest.raises(PlanError, match="rollout.tensor_parallel_size=4 exceeds the 2 GPUs of a data-parallel"):
        make_plan(_trainer_tp2_dp2("rollout.tensor_parallel_size=4"), SMALL, PlanOptions(nodes=1, gpus_per_node=4))
    with pytest.raises(PlanError, match=r"rollout.gpu_memory_utilization=0.2 gives vLLM 15.8 GiB per GPU, less than "
                                        r"its weights \(15.0 GiB at rollout.tensor_parallel_size=1\) \+ 2.0 GiB: no "
                                        r"room for a KV cache; raise it or rollout.tensor_parallel_size"):
        make_plan(_separate("rollout.tensor_parallel_size=1", "rollout.num_engines=4",
                            "rollout.gpu_memory_utilization=0.2"), MODEL_SHAPES["llama-3.1-8b"], ONE_NODE)


def test_llama_shapes_match_their_model_cards():
    assert total_params(MODEL_SHAPES["llama-3.1-8b"]) == pytest.approx(8.03e9, rel=0.005)
    assert total_params(MODEL_SHAPES["llama-3.1-70b"]) == pytest.approx(70.6e9, rel=0.005)


def test_the_llama8b_async_recipe_plans_nemo_rl_runs_beside_their_measurements(capsys):
    from megareason.launch.plan_published import compare, format_comparison, published_for

    recipe = "configs/grpo_llama8b_async.yaml"
    plan = plan_config(recipe, [], PlanOptions(), "llama-3.1-8b")
    assert (plan.placement, plan.max_staleness, plan.nodes, plan.trainer_gpus, plan.engines, plan.vllm_tp) == (
        "separate", 1, 2, 8, 8, 1)  # NeMo-RL's two-node layout: the trainer on one node, the engines on the other
    assert plan.weight_transfer == "broadcast"
    assert all(sum(lines.values()) < 79.6 * GiB for lines in plan.memory.values())
    assert plan.step_seconds == plan.off_policy_seconds < plan.sync_seconds
    rows = compare(recipe, [], PlanOptions(), plan_config, "llama-3.1-8b")
    assert [(c.run.step_s, c.plan.placement, c.plan.gpus, c.plan.max_staleness) for c in rows] == [
        (92.8, "colocated", 16, 0), (64.8, "separate", 16, 1)]  # NeMo-RL's layouts, two nodes each
    assert [(c.plan.passes[0].prompt, c.plan.passes[0].response) for c in rows] == [(128, 1019), (128, 1123)]
    assert all(c.plan.gpu.name == "H100-80GB" for c in rows)
    assert "one step off over on-policy" in format_comparison(published_for(recipe), rows)
    assert main(["plan", "--model-shape", "llama-3.1-8b", recipe]) == 0
    out = capsys.readouterr().out
    for text in ("step, synchronous", "step, one step off", "NeMo-RL v0.5", "92.8", "64.8",
                 f"a step {plan.step_seconds:.0f} s"):  # the pre-emption lead's step is the one-step-off one
        assert text in out
    assert main(["plan", "--model-shape", "llama-3.1-8b", recipe, "rollout.num_engines=2"]) == 2
    assert "rollout.num_engines x rollout.tensor_parallel_size = 2 x 1 = 2 engine GPUs" in capsys.readouterr().err


def test_host_memory_per_node_is_planned_and_a_node_without_room_for_the_checkpoint_gather_is_refused():
    """Qwen3-8B: a node's 8 ranks hold their pinned offload copies, vLLM's sleep copy and megatron-core's
    fully_reshardable gather at the save (the same figure as preflight's, tests/test_preflight.py); a 512 GiB node
    is refused, naming what fits."""
    from megareason.launch.preflight import host_memory_per_node

    plan = plan_config("configs/grpo_qwen3_8b.yaml", [], PlanOptions(gpus_per_node=8), "qwen3-8b")
    state, need = host_memory_per_node(load_config("grpo_qwen3_8b"), MODEL_SHAPES["qwen3-8b"], 8)
    assert max(plan.host_per_node, key=plan.host_per_node.get) == state == "save"
    assert plan.host_per_node["save"] == need <= 2048 * GiB
    with pytest.raises(PlanError, match=r"does not fit host memory: the save state needs 854 GiB per node of 8 ranks "
                                        r"> --node-memory-gib 512 .*dp_reshardable"):
        plan_config("configs/grpo_qwen3_8b.yaml", [], PlanOptions(gpus_per_node=8, node_memory_gib=512), "qwen3-8b")
