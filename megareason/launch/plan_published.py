"""``megareason plan`` beside published measurements: a recipe made to match a published run is planned in
each of that run's layouts, at its measured mean response length, and printed next to its measured seconds
per step. The runs are a declarative table, keyed by the recipe's file name (``configs/<name>.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from megareason.launch.plan_records import Plan, PlanOptions


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: what it was, its seconds per step and mean generated tokens per response, and the
    config overrides that turn the recipe into its layout (none: the recipe as it is)."""

    name: str
    step_s: float
    response_tokens: int
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Published:
    """Where the runs were published, on which GPU, and their prompts' mean length in tokens (derived where
    the source gives tokens per second per GPU but no prompt length)."""

    source: str
    gpu: str
    prompt_tokens: int
    runs: tuple[PublishedRun, ...]


# NeMo-RL v0.5's performance summary (docs/about/performance-summary.md, NVIDIA-NeMo/RL commit 108bffdab,
# 2026-01-20; recipes examples/configs/recipes/llm/performance/grpo-llama3.1-8b-instruct-2n8g.yaml and
# -async-1off.yaml at v0.5.0). Its "G-Average Seq len" is the mean generated length (1,019 and 1,123); its
# tokens per second per GPU x 16 GPUs x seconds per step / 2,048 samples gives 1,146 and 1,254 tokens a
# sample, so prompts of ~128 tokens. The on-policy run: Megatron TP 1 x PP 2 x DP 8 with 16 vLLM engines of
# TP 1, colocated; megareason's colocated engines at rollout TP 1 are one per DP replica (8 of 16 GPUs would
# generate), so it is planned with 8 SPMD engines of TP 2 (every GPU generates), and with vLLM's share
# lowered from NeMo-RL's 0.6 to 0.5, the trainer's gradients and optimizer state in host memory while vLLM is
# awake (as NeMo-RL's offload_before_refit: its resume otherwise leaves under 5 GiB free, launch/ledger.py).
_NEMO_RL_COLOCATED = ("rollout.placement=colocated", "rollout.num_engines=1", "trainer.max_staleness=0",
                      "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
                      "parallel.pipeline_model_parallel_size=2", "parallel.data_parallel_size=8",
                      "rollout.tensor_parallel_size=2", "rollout.gpu_memory_utilization=0.5",
                      "trainer.offload_optimizer=true")
# The one-step-off run: the recipe's own layout, training on one node (TP 4 x DP 2: the recipe's TP 4 in place
# of NeMo-RL's TP 1, see docs/planner.md), its 8 engines on the other, fed by broadcast.
_NEMO_RL_ONE_STEP_OFF = ("parallel.data_parallel_size=2", "rollout.num_engines=8")
PUBLISHED = {
    "grpo_llama8b_async": Published(
        source="NeMo-RL v0.5 performance summary (DGX-H100, bf16, Megatron; Llama-3.1-8B-Instruct GRPO on "
               "OpenMathInstruct-2, 64 prompts x 32 samples, 4 optimizer steps of 512, max sequence 4,096)",
        gpu="H100-80GB", prompt_tokens=128,
        runs=(PublishedRun("on-policy, colocated", 92.8, 1019, _NEMO_RL_COLOCATED),
              PublishedRun("one step off, separate, 2 nodes", 64.8, 1123, _NEMO_RL_ONE_STEP_OFF)),
    ),
}


@dataclass
class Compared:
    run: PublishedRun
    plan: Plan


def published_for(config: str) -> Published | None:
    """The published runs a recipe was made to match: ``config`` is a name in configs/ or a YAML path."""
    return PUBLISHED.get(Path(config).stem)


def compare(config: str, overrides: list[str], opt: PlanOptions, plan_config, model_shape: str = "") -> list[Compared]:
    """Plan ``config`` (with ``overrides``) in each published run's layout, on the run's GPU, 8 to a node, at
    its mean prompt and response lengths (the other options, MFU among them, are ``opt``'s), with
    ``plan_config`` (``launch.plan``'s, passed in: that module prints these). [] when no run was published
    for it."""
    from megareason.config import load_config

    published = published_for(config)
    if published is None:
        return []
    path = Path(config)
    is_file = path.suffix in (".yaml", ".yml") or "/" in config
    cfg = load_config(path.stem if is_file else config, overrides, path.parent if is_file else None)
    base = replace(opt, gpu=published.gpu, nodes=0, gpus_per_node=8,
                   prompt_fraction=published.prompt_tokens / cfg.data.max_prompt_length)
    return [Compared(run, plan_config(config, [*overrides, *run.overrides],
                                      replace(base, response_tokens=run.response_tokens), model_shape))
            for run in published.runs]


def _layout(plan: Plan) -> str:
    gpus = f"{plan.trainer_gpus} + {plan.engine_gpus}" if plan.placement == "separate" else f"{plan.gpus}"
    return (f"{gpus} GPUs: TP {plan.tp} x PP {plan.pp} x DP {plan.dp}, {plan.engines} engines x TP "
            f"{plan.vllm_tp}")


def format_comparison(published: Published, compared: list[Compared]) -> str:
    """The side-by-side table: per run its layout, the plan's phases and step, and the measured step; for a
    one-step-off run also the plan of its layout run synchronously."""
    head = (f"  {'run':<38}{'layout':<50}{'response':>9}{'gen':>7}{'logp':>6}{'train':>7}{'refit':>6}"
            f"{'plan':>7}{'measured':>10}")
    out = [f"next to {published.source}, each run planned at its mean response length (prompts "
           f"{published.prompt_tokens} tokens); seconds per step:", head]
    for c in compared:
        p, s = c.plan, c.plan.seconds
        out.append(f"  {c.run.name:<38}{_layout(p):<50}{c.run.response_tokens:>9}{s['generation']:>7.1f}"
                   f"{s['logprobs']:>6.1f}{s['training']:>7.1f}{s['weight refit']:>6.1f}{p.step_seconds:>7.1f}"
                   f"{c.run.step_s:>10.1f}")
        if p.max_staleness:
            out.append(f"  {'  the same layout, synchronous':<38}{'':<50}{c.run.response_tokens:>9}{'':>26}"
                       f"{p.sync_seconds:>7.1f}{'-':>10}")
    sync = [c for c in compared if not c.plan.max_staleness]
    off = [c for c in compared if c.plan.max_staleness]
    if sync and off:
        planned = sync[0].plan.step_seconds / off[0].plan.step_seconds
        measured = sync[0].run.step_s / off[0].run.step_s
        out.append(f"  one step off over on-policy: {planned:.2f}x planned, {measured:.2f}x measured (on-policy step / "
                   f"one-step-off step)")
    return "\n".join(out)
