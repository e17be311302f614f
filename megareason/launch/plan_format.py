"""``megareason plan``'s printed table: the plan's allocation, model, layout and settings, memory per GPU
per phase, and seconds per phase with how each was computed."""

from __future__ import annotations

from megareason.launch.plan_records import GiB, Plan


def as_overrides(changes: dict[str, object]) -> str:
    """``key=value`` overrides as the CLI takes them."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items())


def _trainer_resident(plan: Plan) -> float:
    """The trainer's bytes per GPU when vLLM starts (the start-up state's peak, less vLLM's own lines)."""
    lines = plan.memory.get("start-up", plan.memory["generation"])
    return sum(v for k, v in lines.items() if not k.startswith("vLLM"))


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
    separate = plan.placement == "separate"
    split = f" ({plan.trainer_gpus} trainer + {plan.engine_gpus} engine)" if separate else ""
    if separate:
        engines = (f"{plan.engines} engine(s) x TP {plan.vllm_tp} on {plan.engine_gpus} GPUs of their own "
                   f"(rollout.placement=separate), the trainer on {plan.trainer_gpus}")
    else:
        engines = (f"{plan.engines} engine(s) "
                   f"({'SPMD, colocated on consecutive ranks' if plan.vllm_tp > 1 else 'one per DP replica'}) x TP "
                   f"{plan.vllm_tp} = {plan.engine_gpus} of {plan.gpus} GPUs generate")
    out = [
        f"plan: {plan.config_name} on {plan.nodes} node(s) x {plan.gpus_per_node} {g.name} = {plan.gpus} GPUs{split} "
        f"({g.memory_gib} GiB, {g.bf16_flops / 1e12:.0f} TFLOP/s bf16, {g.hbm_bytes_s / 1e12:.2f} TB/s HBM each)",
        f"model: {plan.arch_source}: {a.num_layers} layers, hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, "
        f"{a.num_heads} heads / {a.num_kv_heads} kv heads x {a.head_dim}, vocab {a.vocab_size}; "
        f"{_params(plan)}, {plan.params_per_gpu / 1e9:.3f}B on the most loaded GPU",
        f"layout: Megatron TP {plan.tp} x PP {plan.pp} x DP {plan.dp}{_experts(plan)} ({spec}); vLLM: {engines}",
        *_runtime_note(plan),
        f"settings (from the config): {as_overrides(plan.settings)}",
        f"assumed: MFU {o.mfu:.0%}; mean prompt + response tokens: {lengths}",
        "",
        f"{'memory per GPU (GiB)':<{label + 2}}" + "".join(f"{ph:>{max(10, len(ph) + 1)}}" for ph in plan.memory),
    ]
    phases = tuple(plan.memory)  # the ledger's states (launch/ledger.py), each its peak
    widths = tuple(max(10, len(ph) + 1) for ph in phases)
    if separate:  # the generation column is an engine's GPU, the others the trainer's
        out.append(f"  {'(on the GPUs of)':<{label}}" + "".join(
            f"{'an engine' if ph == 'generation' else 'trainer':>{w}}" for ph, w in zip(phases, widths, strict=True)))
    lines = list(dict.fromkeys(k for phase in plan.memory.values() for k in phase))
    for line in lines:
        cells = [plan.memory[ph].get(line) for ph in phases]
        out.append(f"  {line:<{label}}" + "".join(f"{'-' if c is None else f'{c / GiB:.1f}':>{w}}"
                                           for c, w in zip(cells, widths, strict=True)))
    totals = [sum(plan.memory[ph].values()) / GiB for ph in phases]
    out.append(f"  {'total (of ' + str(g.cuda_total_gib) + ', cudaMemGetInfo)':<{label}}" + "".join(
        f"{x:>{w}.1f}" for x, w in zip(totals, widths, strict=True)))
    out.append(f"  {'free':<{label}}" + "".join(f"{g.cuda_total_gib - x:>{w}.1f}" for x, w in
                                                zip(totals, widths, strict=True)))
    if plan.host_per_node:
        out.append(f"  {f'host memory per node, {plan.gpus_per_node} ranks (of {o.node_memory_gib:g})':<{label}}"
                   + "".join(f"{plan.host_per_node.get(ph, 0) / GiB:>{w}.0f}" for ph, w in zip(phases, widths,
                                                                                             strict=True)))
    act = plan.activations_by_recompute
    stages = ["-" if separate and ph == "generation" else plan.stages[ph] for ph in phases]
    out += [
        f"  {'pipeline stage':<{label}}" + "".join(f"{s:>{w}}" for s, w in zip(stages, widths, strict=True)),
        f"  training activations by trainer.recompute: none {act['none'] / GiB:.1f}, selective "
        f"{act['selective'] / GiB:.1f}, full (every layer) {act['full'] / GiB:.1f} GiB",
        f"  KV cache: {plan.kv_tokens_per_engine:,} tokens per engine ({plan.kv_bytes_per_token / 1024:.0f} KiB per "
        f"token per GPU)",
        _vllm_start(plan),
        "",
        f"{'time per step (estimate)':<26}{'seconds':>8}   basis",
    ]
    for phase, s in plan.seconds.items():
        out.append(f"  {phase:<24}{s:>8.1f}   {plan.notes[phase]}")
    if not separate:
        out.append(f"  {'total':<24}{plan.sync_seconds:>8.1f}")
        if plan.engine_gpus < plan.gpus:
            out.append(f"  (generation with an engine on every GPU, {plan.gpus // plan.vllm_tp} engines: "
                       f"{plan.generation_all_gpus:.1f} s)")
        return "\n".join(out)
    return "\n".join(out + _step_lines(plan))


def _runtime_note(plan: Plan) -> list[str]:
    """Separate engines on another node than the trainer's first rank need the broadcast weight transfer."""
    if plan.placement != "separate" or plan.nodes == 1 or plan.weight_transfer == "broadcast":
        return []
    return ["note: rollout.weight_transfer: shm pushes the weights through shared memory on the node of the "
            "trainer's first rank, and the runtime refuses engines on another node (trainer/pool.py): set "
            "rollout.weight_transfer=broadcast; the refit below plans that"]


def _vllm_start(plan: Plan) -> str:
    """vLLM starts after the actor and refuses to unless free memory >= gpu_memory_utilization x total
    (vllm/v1/worker/gpu_worker.py); colocated, the generation column is that sum, so it fits iff vLLM starts."""
    if plan.placement == "separate":
        return (f"  vLLM start-up: an engine's GPU holds vLLM alone, rollout.gpu_memory_utilization x total = "
                f"{_vllm_share(plan) / GiB:.1f} GiB of {plan.gpu.cuda_total_gib}; the trainer's GPUs hold no vLLM")
    free = plan.gpu.cuda_total_gib - _trainer_resident(plan) / GiB
    return (f"  vLLM start-up: {free:.1f} GiB free beside the trainer's "
            f"{_trainer_resident(plan) / GiB:.1f} GiB, needs rollout.gpu_memory_utilization x total = "
            f"{_vllm_share(plan) / GiB:.1f} GiB")


def _step_lines(plan: Plan) -> list[str]:
    """Separate engines: the synchronous and the one-step-off step, and what waits for what in the latter."""
    sec = plan.seconds
    gen, refit, train = sec["generation"], sec["weight refit"], sec["logprobs"] + sec["training"]
    this = f"   <- this config (trainer.max_staleness={plan.max_staleness})"
    mark = (this, "") if plan.max_staleness == 0 else ("", this)
    idle = (f"the trainer waits {gen - train:.1f} s a step for generation" if gen > train else
            f"the engines idle {train - gen:.1f} s a step")
    return [
        f"  {'step, synchronous':<24}{plan.sync_seconds:>8.1f}   generation + log-probs + training + refit, one "
        f"after another{mark[0]}",
        f"  {'step, one step off':<24}{plan.off_policy_seconds:>8.1f}   refit + max(generation, log-probs + "
        f"training){mark[1]}",
        "",
        "one step off (trainer.max_staleness=1), step k in steady state:",
        "  1. wait for batch k, whose generation was launched during step k-1",
        f"  2. weight refit {refit:.1f} s: the weights of step k-1 into the engines, idle meanwhile (vLLM cannot "
        f"generate while its weights are replaced)",
        f"  3. launch batch k+1: the engines generate it ({gen:.1f} s) with those weights, one step stale, while the "
        f"trainer scores batch k (not modelled) and runs its log-probs ({sec['logprobs']:.1f} s) and training step k "
        f"({sec['training']:.1f} s) = {train:.1f} s",
        f"  step = {refit:.1f} + max({gen:.1f}, {train:.1f}) = {plan.off_policy_seconds:.1f} s, "
        f"{plan.sync_seconds / plan.off_policy_seconds:.2f}x the synchronous step; {idle}",
    ]

