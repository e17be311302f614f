"""``megareason plan``'s printed table: the plan's allocation, model, layout and settings, memory per GPU
per phase, and seconds per phase with how each was computed."""

from __future__ import annotations

from megareason.launch.plan_records import GiB, Plan


def as_overrides(changes: dict[str, object]) -> str:
    """``key=value`` overrides as the CLI takes them."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def _trainer_resident(plan: Plan) -> float:
    """The trainer's bytes per GPU while vLLM is awake (its states stay resident; the reference is offloaded)."""
    return sum(v for k, v in plan.memory["generation"].items() if not k.startswith("vLLM"))


def _vllm_share(plan: Plan) -> float:
    return sum(v for k, v in plan.memory["generation"].items() if k.startswith("vLLM"))


def _params(plan: Plan) -> str:
    """The model's parameter count for the header: an MoE's total, active per token, and its experts."""
    a = plan.arch
    if not a.is_moe:
        return f"{plan.total_params / 1e9:.2f}B parameters"
    return (f"{plan.total_params / 1e9:.2f}B parameters total, {plan.active_params / 1e9:.2f}B active per token "
            f"({a.moe_top_k} of {a.num_experts} experts of ffn {a.moe_ffn_hidden_size} per layer)")


def _experts(plan: Plan) -> str:
    """The layout's expert parallelism (an MoE's only): EP, experts per GPU and the expert-data-parallel size."""
    if not plan.arch.is_moe:
        return ""
    local = plan.arch.num_experts // plan.ep
    return f", EP {plan.ep} ({local} expert{'s' * (local > 1)} per GPU, expert DP {plan.dp // plan.ep})"


def format_plan(plan: Plan) -> str:
    """The plan as the table `megareason plan` prints."""
    a, g, o = plan.arch, plan.gpu, plan.options
    spec = "TransformerEngine layers" if plan.spec == "te" else "megatron-core's local layers (LoRA)"
    label = max([60] + [len(line) + 1 for phase in plan.memory.values() for line in phase])  # column width
    lengths = ", ".join(f"{ps.name} {ps.prompt:.0f} + {ps.response:.0f} (longest {ps.max_response})"
                        for ps in plan.passes)
    out = [
        f"plan: {plan.config_name} on {plan.nodes} node(s) x {plan.gpus_per_node} {g.name} = {plan.gpus} GPUs "
        f"({g.memory_gib} GiB, {g.bf16_flops / 1e12:.0f} TFLOP/s bf16, {g.hbm_bytes_s / 1e12:.2f} TB/s HBM each)",
        f"model: {plan.arch_source}: {a.num_layers} layers, hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, "
        f"{a.num_heads} heads / {a.num_kv_heads} kv heads x {a.head_dim}, vocab {a.vocab_size}; "
        f"{_params(plan)}, {plan.params_per_gpu / 1e9:.3f}B on the most loaded GPU",
        f"layout: Megatron TP {plan.tp} x PP {plan.pp} x DP {plan.dp}{_experts(plan)} ({spec}); vLLM: "
        f"{plan.engines} engine(s) "
        f"({'SPMD, colocated on consecutive ranks' if plan.vllm_tp > 1 else 'one per DP replica'}) x TP "
        f"{plan.vllm_tp} = {plan.engines * plan.vllm_tp} of {plan.gpus} GPUs generate",
        f"settings (from the config): {as_overrides(plan.settings)}",
        f"assumed: MFU {o.mfu:.0%}; mean prompt + response tokens: {lengths}",
        "",
        f"{'memory per GPU (GiB)':<{label + 2}}{'generation':>11}{'sync':>10}{'training':>10}{'logprobs':>10}",
    ]
    phases = ("generation", "sync", "training", "logprobs")
    widths = (11, 10, 10, 10)
    lines = list(dict.fromkeys(k for phase in plan.memory.values() for k in phase))
    for line in lines:
        cells = [plan.memory[ph].get(line) for ph in phases]
        out.append(f"  {line:<{label}}" + "".join(f"{'-' if c is None else f'{c / GiB:.1f}':>{w}}"
                                           for c, w in zip(cells, widths, strict=True)))
    totals = [sum(plan.memory[ph].values()) / GiB for ph in phases]
    out.append(f"  {'total (of ' + str(g.memory_gib) + ')':<{label}}" + "".join(f"{x:>{w}.1f}" for x, w in
                                                                           zip(totals, widths, strict=True)))
    act = plan.activations_by_recompute
    out += [
        f"  {'pipeline stage':<{label}}" + "".join(f"{plan.stages[ph]:>{w}}" for ph, w in zip(phases, widths,
                                                                                         strict=True)),
        f"  training activations by trainer.recompute: none {act['none'] / GiB:.1f}, selective "
        f"{act['selective'] / GiB:.1f}, full (every layer) {act['full'] / GiB:.1f} GiB",
        f"  KV cache: {plan.kv_tokens_per_engine:,} tokens per engine ({plan.kv_bytes_per_token / 1024:.0f} KiB per "
        f"token per GPU)",
        # vLLM starts after the actor and refuses to unless free memory >= gpu_memory_utilization x total
        # (vllm/v1/worker/gpu_worker.py); the generation column is that sum, so it fits iff vLLM starts.
        f"  vLLM start-up: {g.memory_gib - _trainer_resident(plan) / GiB:.1f} GiB free beside the trainer's "
        f"{_trainer_resident(plan) / GiB:.1f} GiB, needs rollout.gpu_memory_utilization x total = "
        f"{_vllm_share(plan) / GiB:.1f} GiB",
        "",
        f"{'time per step (estimate)':<26}{'seconds':>8}   basis",
    ]
    for phase, s in plan.seconds.items():
        out.append(f"  {phase:<24}{s:>8.1f}   {plan.notes[phase]}")
    out.append(f"  {'total':<24}{sum(plan.seconds.values()):>8.1f}")
    if plan.engines * plan.vllm_tp < plan.gpus:
        out.append(f"  (generation with an engine on every GPU, {plan.gpus // plan.vllm_tp} engines: "
                   f"{plan.generation_all_gpus:.1f} s)")
    return "\n".join(out)

