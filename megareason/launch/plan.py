"""``megareason plan``: will a training config fit an allocation of GPUs, and how long will a step take?

A back-of-the-envelope model, written out so that every number can be checked by hand. It plans the
trainer the config describes: ``trainer.precision``, ``trainer.recompute`` (+ ``recompute_num_layers``),
``optim.use_distributed_optimizer`` and ``parallel.sequence_parallel`` are read from the config, never
assumed, and a config that does not fit is refused with the setting that would make it fit.

* **Memory per GPU**, per phase of the colocated layout (vLLM and Megatron share every GPU), on the most
  loaded pipeline stage of each phase: generation (Megatron's resident states + vLLM's
  ``gpu_memory_utilization`` share), training (states + activations; vLLM asleep) and log-probs (states +
  the reference model onloaded + a forward's working set). The byte formulas (parameters, gradients,
  optimizer states per precision and distributed optimizer; activations per layer implementation,
  recomputation and sequence parallelism) are in :mod:`megareason.launch.plan_memory`, whose
  ``memory_per_rank`` gives them for one micro-batch on one rank. Training holds, on stage s under 1F1B,
  min(PP - s, micro-batches) micro-batches' saved activations plus one recomputed layer's rerun.
* **Time per step** from FLOPs (6·N·tokens to train, 2·N·tokens per forward, plus causal attention;
  recomputation adds the rerun forward of the recomputed layers) at an assumed MFU of the precision's
  peak (bf16/fp16 tensor cores, or fp32 without TF32), and from bandwidth for decoding: every decode step
  of a vLLM engine reads its weight shard and the KV cache of the running sequences from HBM. Refit is
  bytes over the network (PP stages live on other nodes) and NVLink plus a per-bucket RPC cost.

Mixtures of experts (``parallel.expert_model_parallel_size`` EP ranks, carved out of DP, each holding
num_experts / EP experts split over TP): memory counts the TOTAL parameters (dense ones over TP x PP,
experts over TP x PP x EP, their distributed-optimizer state over DP / EP), activations and FLOPs (N above)
the ACTIVE ones (a token runs its top-k experts); training and log-prob passes add the token dispatch's
all-to-alls; vLLM holds every expert over the rollout TP, and a decode step reads the experts its batch
routes to.

Separate engines (``rollout.placement=separate``): the job's GPUs split into the trainer's TP x PP x DP and
``rollout.num_engines`` x ``rollout.tensor_parallel_size`` of the engines' own, which must add up to the
allocation. The trainer's GPUs hold no vLLM (nothing sleeps or wakes), an engine's GPU holds vLLM alone
(weights + KV cache within ``gpu_memory_utilization``, plus a weight-sync bucket in flight); generation runs
on the engines, training and log-probs on the trainer's GPUs, and the refit broadcasts the gathered model
to every engine GPU over the network (NVLink on one node). ``trainer.max_staleness=1`` overlaps generation
with training: a step is refit + max(generation, log-probs + training) instead of the sum
(``plan_records.step_seconds``); both are printed. ``plan_published`` prints a recipe made to match a
published run (``configs/grpo_llama8b_async.yaml``: NeMo-RL's Llama-3.1-8B) beside its measurements.

``make_plan`` is pure (config + shape + allocation in, numbers out); ``format_plan`` prints it; problems
that make a plan impossible raise :class:`PlanError` naming the config field(s) and, when one exists, the
cheapest change of the settings above that makes the plan fit.

The code: :mod:`~megareason.launch.plan_records` (GPUs, model shapes, options, the ``Plan`` record, the step
time), :mod:`~megareason.launch.plan_memory` (bytes), :mod:`~megareason.launch.plan_time` (seconds),
:mod:`~megareason.launch.plan_format` (the printed table), :mod:`~megareason.launch.plan_published` (published
runs beside their plans); this module builds and checks a plan.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

from megareason.config.schema import Config
from megareason.launch.ledger import (
    MARGIN_GIB,
    NCCL_COMMUNICATOR_GIB,
    STATES,
    VLLM_ASLEEP_GIB,
    VLLM_RESERVE_GIB,
    megatron_communicators,
    plan_states,
    rank_terms,
    vllm_share,
)
from megareason.launch.plan_format import as_overrides, format_plan
from megareason.launch.plan_memory import (
    active_params,
    layer_spec,
    params_per_gpu,
    recomputed_layers,
    stage_activations,
    total_params,
)
from megareason.launch.plan_records import (
    GPU,
    GPUS,
    MODEL_SHAPES,
    GiB,
    Plan,
    PlanError,
    PlanOptions,
    element_bytes,
    kv_bytes_per_token,
    workload,
)
from megareason.launch.plan_time import add_seconds, decode_step_seconds
from megareason.models.arch import ModelArch

# The names tests and other modules import from here.
__all__ = ["GPUS", "MARGIN_GIB", "MODEL_SHAPES", "NCCL_COMMUNICATOR_GIB", "VLLM_ASLEEP_GIB", "Plan",
           "megatron_communicators", "PlanError", "PlanOptions", "decode_step_seconds", "format_plan",
           "kv_bytes_per_token", "make_plan", "plan_config", "rollout_engines", "workload"]

# The trainer's memory settings: read from the config, varied only to say what would make a plan fit.
SETTINGS = ("trainer.precision", "optim.use_distributed_optimizer", "trainer.recompute",
            "trainer.recompute_num_layers", "parallel.sequence_parallel", "trainer.offload_optimizer")


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _with(cfg: Config, changes: dict[str, object]) -> Config:
    for key, value in changes.items():
        section, name = key.split(".")
        cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    return cfg


def settings_of(cfg: Config) -> dict[str, object]:
    """The memory settings the trainer runs with (``recompute_num_layers`` only with full recompute)."""
    keys = [k for k in SETTINGS if k != "trainer.recompute_num_layers" or cfg.trainer.recompute == "full"]
    return {k: _get(cfg, k) for k in keys}





def make_plan(cfg: Config, arch: ModelArch, opt: PlanOptions, *, config_name: str = "",
              arch_source: str = "") -> Plan:
    """The plan of ``cfg`` on ``opt``'s allocation. Raises :class:`PlanError` (or ``ArchError``) when
    the layout does not match the allocation or a phase does not fit in GPU memory; then the message
    names the settings that would make it fit, if any do."""
    if opt.gpu not in GPUS:
        raise PlanError(f"--gpu {opt.gpu!r} is not known; known: {', '.join(GPUS)}")
    gpu = GPUS[opt.gpu]
    p, r, t = cfg.parallel, cfg.rollout, cfg.trainer
    tp, pp, ep, vtp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size,
                       r.tensor_parallel_size)
    nodes = _check_gpus(cfg, opt)
    arch.check_parallelism(tp, pp, ep)
    _check_moe(cfg, arch)
    if p.sequence_parallel and tp == 1:
        raise PlanError("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1")
    if t.recompute == "full" and t.recompute_num_layers > arch.num_layers // pp:
        raise PlanError(f"trainer.recompute_num_layers={t.recompute_num_layers} is more than the "
                        f"{arch.num_layers // pp} layers of a pipeline stage")
    if r.placement == "colocated" and vtp > tp * pp:
        raise PlanError(f"rollout.tensor_parallel_size={vtp} exceeds the {tp * pp} GPUs of a data-parallel "
                        f"replica (parallel.tensor_model_parallel_size x pipeline_model_parallel_size), which "
                        f"its colocated vLLM engine runs on")
    if arch.num_heads % vtp or (arch.num_kv_heads % vtp and vtp % arch.num_kv_heads):
        raise PlanError(f"rollout.tensor_parallel_size={vtp} does not split {arch.num_heads} attention heads / "
                        f"{arch.num_kv_heads} kv heads (vLLM needs heads % TP == 0 and kv heads % TP == 0 or "
                        f"TP % kv heads == 0)")
    plan = _plan(cfg, arch, opt, gpu, nodes, config_name, arch_source)
    problem = _problem(plan, cfg)
    if problem is None:
        add_seconds(plan, cfg)
        return plan
    message, hint = problem
    fix = _cheapest_fix(cfg, arch, opt, gpu, nodes)
    if fix is None:
        raise PlanError(f"{message}; {hint}")
    changes, fitted = fix
    peak = max(sum(lines.values()) for lines in fitted.memory.values())
    raise PlanError(f"{message}; set {as_overrides(changes)} to make it fit (then {peak / GiB:.1f} GiB per GPU at the "
                    f"peak, {fitted.step_seconds:.0f} s per step)")


def _check_gpus(cfg: Config, opt: PlanOptions) -> int:
    """The allocation's nodes, once the layout's GPUs are checked against it: colocated, the trainer's
    TP x PP x DP GPUs (vLLM shares them); separate, those plus rollout.num_engines x
    rollout.tensor_parallel_size GPUs of the engines' own. Without --nodes, as many nodes as that needs."""
    p, r = cfg.parallel, cfg.rollout
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    trainer = tp * pp * dp
    engines = r.num_engines * r.tensor_parallel_size if r.placement == "separate" else 0
    nodes = opt.nodes or max(1, math.ceil((trainer + engines) / opt.gpus_per_node))
    allocation = (f"the allocation's {nodes} nodes x {opt.gpus_per_node} GPUs = {nodes * opt.gpus_per_node}")
    layout = (f"parallel.tensor_model_parallel_size x pipeline_model_parallel_size x data_parallel_size = "
              f"{tp} x {pp} x {dp} = {trainer}")
    if engines == 0 and trainer != nodes * opt.gpus_per_node:
        raise PlanError(f"{layout} GPUs does not equal {allocation}")
    if engines and trainer + engines != nodes * opt.gpus_per_node:
        raise PlanError(f"rollout.placement=separate: {layout} trainer GPUs + rollout.num_engines x "
                        f"rollout.tensor_parallel_size = {r.num_engines} x {r.tensor_parallel_size} = {engines} "
                        f"engine GPUs = {trainer + engines} GPUs does not equal {allocation}")
    return nodes


def _check_moe(cfg: Config, arch: ModelArch) -> None:
    """Refuse what a mixture-of-experts layout cannot run (``check_parallelism`` has refused EP > 1 for a
    dense model): experts split over ranks that are not whole data-parallel groups, TP without sequence
    parallelism, and LoRA (whose adapters the planner counts for dense MLPs only)."""
    p = cfg.parallel
    tp, dp, ep = p.tensor_model_parallel_size, p.data_parallel_size, p.expert_model_parallel_size
    if dp % ep:
        raise PlanError(f"parallel.expert_model_parallel_size={ep} does not divide parallel.data_parallel_size="
                        f"{dp}: the experts are split over data-parallel ranks")
    if arch.is_moe and tp > 1 and not p.sequence_parallel:
        raise PlanError(f"parallel.sequence_parallel=false: a mixture-of-experts model at "
                        f"parallel.tensor_model_parallel_size={tp} needs parallel.sequence_parallel=true "
                        f"(megatron-core trains MoE layers with TP only so)")
    if arch.is_moe and cfg.lora.enabled:
        raise PlanError("lora.enabled=true: the planner does not count LoRA adapters of a mixture-of-experts "
                        f"model ({arch.num_experts} experts per layer)")


def _cheapest_fix(cfg: Config, arch: ModelArch, opt: PlanOptions, gpu: GPU,
                  nodes: int) -> tuple[dict[str, object], Plan] | None:
    """The change of the memory settings that makes the plan fit with the shortest estimated step (then the
    fewest changed fields), and its plan; None if none does. Tried: the distributed optimizer, sequence
    parallelism (TP > 1), bf16 for fp32, more recomputation (selective, then full on 1, 2, ... layers
    of each stage) and, colocated, the optimizer state in host memory while vLLM is awake."""
    t, tp, pp = cfg.trainer, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    choices: list[list[dict[str, object]]] = [[{}], [{}], [{}], [{}], [{}]]
    if not t.offload_optimizer and cfg.rollout.placement == "colocated":
        choices[4].append({"trainer.offload_optimizer": True})
    if not cfg.optim.use_distributed_optimizer:
        choices[0].append({"optim.use_distributed_optimizer": True})
    if tp > 1 and not cfg.parallel.sequence_parallel:
        choices[1].append({"parallel.sequence_parallel": True})
    if t.precision == "fp32":
        choices[2].append({"trainer.precision": "bf16"})
    if t.recompute == "none":
        choices[3].append({"trainer.recompute": "selective"})
    per_stage = arch.num_layers // pp
    for n in range(recomputed_layers(cfg, arch, pp) + 1, per_stage + 1):
        choices[3].append({"trainer.recompute": "full", "trainer.recompute_num_layers": 0 if n == per_stage else n})
    best = None
    for parts in itertools.product(*choices):
        changes = {k: v for part in parts for k, v in part.items()}
        if not changes:
            continue
        changed = _with(cfg, changes)
        plan = _plan(changed, arch, opt, gpu, nodes, "", "")
        if _problem(plan, changed) is None:
            add_seconds(plan, changed)
            cost = (round(plan.step_seconds, 6), len(changes))
            if best is None or cost < best[0]:
                best = (cost, changes, plan)
    return None if best is None else (best[1], best[2])


def _plan(cfg: Config, arch: ModelArch, opt: PlanOptions, gpu: GPU, nodes: int, config_name: str,
          arch_source: str) -> Plan:
    """The plan's memory (its seconds come from ``_add_seconds``)."""
    p, r, t, alg = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algorithm
    tp, pp, dp, vtp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                       r.tensor_parallel_size)
    ep = p.expert_model_parallel_size
    spec = layer_spec(cfg)
    separate = r.placement == "separate"

    # Micro-batches per DP rank and mini-batch; stage s holds min(PP - s, that many) under 1F1B.
    passes = workload(cfg, opt)
    rows_tokens = sum(ps.tokens for ps in passes)
    micro = max(1, math.ceil(rows_tokens / (dp * alg.mini_batches) / t.micro_batch_tokens))
    tok = t.micro_batch_tokens

    # Every state's figures are the ledger's peaks (launch/ledger.py) after the loop's transitions on each stage.
    dbytes = element_bytes(r.dtype)
    vllm_weights, kv = vllm_share(cfg, arch, gpu)
    kv_tok = kv_bytes_per_token(arch, vtp, dbytes)
    # Separate engines: an engine's GPU holds vLLM alone and receives a bucket at a time beside its share.
    engine = {"vLLM weights": vllm_weights, "vLLM KV cache": kv,
              "vLLM activations + non-torch (reserve)": VLLM_RESERVE_GIB * GiB,
              "weight sync: a received bucket (beside vLLM's share)": t.weight_sync_bucket_mb * 2**20}

    def training_activations(c: Config, stage: int) -> float:
        a = stage_activations(c, arch, tp, pp, tok, stage)
        return min(pp - stage, micro) * a.saved + a.working

    per_stage: list[dict[str, dict[str, float]]] = []
    host: list[dict[str, int]] = []
    for stage in range(pp):
        terms = rank_terms(cfg, arch, gpu, stage, rows_tokens)
        led = plan_states(cfg, terms)
        phases = {state: terms.lines(led.peaks[state]) for state in STATES if state in led.peaks}
        if separate:
            phases["generation"] = dict(engine)
        per_stage.append(phases)
        host.append(led.host_peaks)
    stages = {ph: max(range(pp), key=lambda s, ph=ph: sum(per_stage[s][ph].values())) for ph in per_stage[0]}
    by_recompute = {}
    for name in ("none", "selective", "full"):
        c = _with(cfg, {"trainer.recompute": name, "trainer.recompute_num_layers": 0})
        by_recompute[name] = max(training_activations(c, s) for s in range(pp))
    return Plan(config_name=config_name, arch=arch, arch_source=arch_source, gpu=gpu, nodes=nodes,
                gpus_per_node=opt.gpus_per_node, tp=tp, pp=pp, dp=dp, ep=ep,
                engines=r.num_engines if separate else rollout_engines(tp * pp * dp, vtp, dp), vllm_tp=vtp,
                placement=r.placement, max_staleness=t.max_staleness, weight_transfer=r.weight_transfer,
                settings=settings_of(cfg), spec=spec,
                options=opt, params_per_gpu=params_per_gpu(arch, tp, pp, ep), total_params=total_params(arch),
                active_params=active_params(arch), memory={ph: per_stage[s][ph] for ph, s in stages.items()},
                stages=stages, activations_by_recompute=by_recompute,
                kv_tokens_per_engine=max(0, int(kv // kv_tok)), kv_bytes_per_token=kv_tok, passes=passes,
                host_per_node={st: opt.gpus_per_node * max(h.get(st, 0) for h in host) for st in per_stage[0]})


def rollout_engines(world: int, vllm_tp: int, dp: int) -> int:
    """vLLM engines of the trainer (trainer/workers.py): at rollout.tensor_parallel_size > 1 one SPMD
    engine per ``vllm_tp`` consecutive ranks (every GPU generates, ``rollout/colocated.py``); at 1 one
    engine per data-parallel replica, on its first rank."""
    return world // vllm_tp if vllm_tp > 1 else dp



def _problem(plan: Plan, cfg: Config) -> tuple[str, str] | None:
    """Why the plan cannot run (naming the fields) and which other field would lower it, or None."""
    cap = (plan.gpu.cuda_total_gib - MARGIN_GIB) * GiB
    weights, kv = vllm_share(cfg, plan.arch, plan.gpu)
    if kv <= 0:
        return (f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} gives vLLM "
                f"{cfg.rollout.gpu_memory_utilization * plan.gpu.cuda_total_gib:.1f} GiB per GPU, less than its "
                f"weights "
                f"({weights / GiB:.1f} GiB at rollout.tensor_parallel_size={plan.vllm_tp}) + "
                f"{VLLM_RESERVE_GIB} GiB: no room for a KV cache",
                "raise it" + (" or rollout.tensor_parallel_size" if plan.placement == "separate" else ""))
    if plan.kv_tokens_per_engine < cfg.rollout.max_model_len:
        return (f"rollout.max_model_len={cfg.rollout.max_model_len} does not fit the KV cache of "
                f"{plan.kv_tokens_per_engine} tokens (rollout.gpu_memory_utilization="
                f"{cfg.rollout.gpu_memory_utilization})", "lower it or raise rollout.gpu_memory_utilization")
    for phase, lines in plan.memory.items():
        need = sum(lines.values())
        if need > cap:
            big = max(lines, key=lines.get)
            fix = {"generation": "lower rollout.gpu_memory_utilization", "training": "lower trainer.micro_batch_tokens"
                   }.get(phase, "raise parallel.tensor_model_parallel_size")
            if not big.startswith(("activations", "vLLM")):
                fix = ("split the model over more GPUs: parallel.tensor_model_parallel_size / "
                       f"pipeline_model_parallel_size{' / expert_model_parallel_size' if plan.arch.is_moe else ''}")
            return (f"does not fit: the {phase} phase needs {need / GiB:.1f} GiB per GPU > {cap / GiB:.1f} GiB "
                    f"(cudaMemGetInfo's {plan.gpu.cuda_total_gib} GiB on {plan.gpu.name} less a {MARGIN_GIB:g} GiB "
                    f"margin) with {as_overrides(plan.settings)}; largest: {big} {lines[big] / GiB:.1f} GiB",
                    f"no change of {', '.join(SETTINGS)} makes it fit: {fix}")
    if plan.host_per_node:
        state = max(plan.host_per_node, key=plan.host_per_node.get)
        host, ram = plan.host_per_node[state], plan.options.node_memory_gib
        if host > ram * GiB:
            return (f"does not fit host memory: the {state} state needs {host / GiB:.0f} GiB per node of "
                    f"{plan.gpus_per_node} ranks > --node-memory-gib {ram:g} (megatron-core's fully_reshardable "
                    f"save gathers ~20 bytes per parameter of each rank's shard into host memory on every rank)",
                    "save in megatron-core's dp_reshardable format (no gather over DP), or spread the ranks over "
                    "more nodes")
    return None


# ----------------------------------------------------------------------------------------- entry point


def resolve_arch(cfg: Config, model_shape: str) -> tuple[ModelArch, str]:
    """The model's shape: a ``--model-shape`` preset, else the HF config.json at model.path."""
    if model_shape:
        if model_shape not in MODEL_SHAPES:
            raise PlanError(f"--model-shape {model_shape!r} is not known; known: {', '.join(MODEL_SHAPES)}")
        return MODEL_SHAPES[model_shape], f"{model_shape} (--model-shape)"
    from megareason.models.hub import resolve_model_config

    try:
        path = resolve_model_config(cfg.model.path)
    except FileNotFoundError as e:
        raise PlanError(f"{e}; or pass --model-shape ({', '.join(MODEL_SHAPES)}) to plan without the "
                        "weights") from e
    return ModelArch.from_pretrained(path), str(path)


def plan_config(config: str, overrides: list[str], opt: PlanOptions, model_shape: str = "") -> Plan:
    """Load ``config`` (a name in configs/ or a path to a YAML file), validate it for training and plan it."""
    from megareason.config import load_config, validate_training

    path = Path(config)
    if path.suffix in (".yaml", ".yml") or "/" in config:
        cfg = load_config(path.stem, overrides, path.parent)
    else:
        cfg = load_config(config, overrides)
    validate_training(cfg)
    arch, source = resolve_arch(cfg, model_shape)
    return make_plan(cfg, arch, opt, config_name=config, arch_source=source)


HELP = """\
Print, per GPU, the memory of parameters, gradients, optimizer states, activations and the vLLM KV cache
in each phase of a step (generation, training, log-probs), and the estimated seconds per phase from FLOPs
and memory bandwidth. The trainer's memory settings come from the config (trainer.precision,
trainer.recompute, trainer.recompute_num_layers, optim.use_distributed_optimizer,
parallel.sequence_parallel). Mixtures of experts: weights, gradients and optimizer states count every
expert (each GPU holds num_experts / parallel.expert_model_parallel_size of them), activations and FLOPs
the top-k experts a token runs. rollout.placement=separate: the trainer on TP x PP x DP GPUs, the vLLM
engines (rollout.num_engines x rollout.tensor_parallel_size GPUs) on GPUs of their own; the synchronous
step and the one-step-off one (trainer.max_staleness=1: refit + max(generation, log-probs + training)) are
both printed. Refuses (exit code 2, naming the field) a layout whose GPUs (TP x PP x DP, plus the engines'
when separate) are not the allocation's GPU count, or a config that does not fit, saying which settings
would make it fit. The model's shape comes from model.path's config.json, or from --model-shape to plan
without the weights. A recipe made to match a published run is printed beside its measurements.
See docs/planner.md.

examples:
  megareason plan --model-shape llama-3.1-70b --nodes 8 --gpus-per-node 8 configs/raro_70b.yaml
  megareason plan --model-shape llama-3.1-70b configs/raro_70b.yaml trainer.recompute=none   # refused
  megareason plan --gpus-per-node 1 --gpu A100-80GB grpo_smollm2_cpu
  megareason plan --model-shape qwen3-30b-a3b configs/grpo_qwen3_30b_a3b.yaml
  megareason plan --model-shape llama-3.1-8b configs/grpo_llama8b_async.yaml   # separate, one step off
"""


def add_arguments(p) -> None:
    d = PlanOptions()
    p.add_argument("config", help="a config name in configs/ or a path to a YAML file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--nodes", type=int, default=d.nodes, help="default: as many as the layout needs")
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--gpu", choices=list(GPUS), default=d.gpu)
    p.add_argument("--model-shape", choices=list(MODEL_SHAPES), default="",
                   help="plan this architecture instead of reading model.path's config.json")
    p.add_argument("--node-memory-gib", type=float, default=d.node_memory_gib,
                   help="host memory of a node, for the host memory per node of each state")
    p.add_argument("--mfu", type=float, default=d.mfu, help="assumed model FLOPs utilization")
    p.add_argument("--prompt-fraction", type=float, default=d.prompt_fraction,
                   help="mean prompt length / data.max_prompt_length")
    p.add_argument("--response-fraction", type=float, default=d.response_fraction,
                   help="mean response length / max_tokens")
    p.add_argument("--response-tokens", type=int, default=d.response_tokens,
                   help="mean policy response length in tokens (instead of --response-fraction for the policy)")


def run_cli(args) -> int:
    from megareason.launch.plan_published import compare, format_comparison, published_for

    opt = PlanOptions(gpu=args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node, mfu=args.mfu,
                      prompt_fraction=args.prompt_fraction, response_fraction=args.response_fraction,
                      response_tokens=args.response_tokens, node_memory_gib=args.node_memory_gib)
    print(format_plan(plan_config(args.config, args.overrides, opt, args.model_shape)))
    published = published_for(args.config)
    if published is not None:  # a recipe made to match a published run: the plan of each of its runs beside it
        print("\n" + format_comparison(published, compare(args.config, args.overrides, opt, plan_config,
                                                              args.model_shape)))
    return 0
