"""The Slurm pre-emption lead: how long before its time limit a job must be told to stop.

``sbatch --signal=B:USR1@LEAD`` sends SIGUSR1 to the job script LEAD seconds before the time limit; the
driver then finishes the step in progress, saves a checkpoint and exits (``trainer/driver.py``), and the job
requeues itself (``slurm/ray_cluster.sh``). That takes up to one whole step plus one checkpoint write, plus
the teardown (Ray stopped, ``scontrol requeue``), so::

    lead = (step seconds + checkpoint seconds) x SAFETY + TEARDOWN_S, rounded up to whole minutes

with the step's seconds from ``megareason plan`` (``launch/plan.py``) and the checkpoint's seconds the
distributed optimizer's gather plus the write of the node that writes the most, at ``--checkpoint-write-gbs``
per node. The gather: before a save, megatron-core's ``fully_reshardable`` format collects on every rank its
replica's whole optimizer state (fp32 main weights and both Adam moments, 12 bytes a trained parameter of the
rank's TP x PP shard: ``get_parameter_state_dp_zero``) through host memory, a shard at a time; measured on an
H200 at 0.52 GB/s a rank (14.83 GB in 28.3 s, ``tools/check_gpu.py``, docs/results/gpu_check_h200.md), the ranks
of a node in parallel. Every trainer rank writes about an equal share of the checkpoint (the data-parallel
replicas split the writing of their TP x PP shard: ``models/checkpoint.py``), so a node writes the checkpoint's
bytes x its trainer ranks / all trainer ranks: bytes / nodes when the trainer fills the nodes; separate rollout
engines write nothing. A checkpoint holds every parameter in the training precision plus the Adam state of every
trainable one: bf16 weights and fp32 main weights + two fp32 moments = 14 bytes per parameter (fp32 training: 4
+ 8 = 12), the critic's again for PPO, and with LoRA the frozen base weights plus the adapters' states. The lead
is printed by ``megareason plan``; ``tests/test_slurm.py`` checks ``slurm/raro_70b.sbatch``'s ``--signal``
against it.

A pre-emption's SIGTERM (to the job's steps, then SIGKILL after the site's GraceTime) stops the step at the
next point where it can stop: a generation (or validation) between two engine steps, a log-prob pass or the
step's first optimizer step between two pieces of its micro-batches (``models/schedule.py``); the step is
dropped and the state before it saved. From the first optimizer step on, the rest of the step's updates (PPO
epochs, mini-batches, the critic's) and the weight sync run to the end, then the step is saved. So a
checkpoint is committed within ``stop_bound``: the longest piece that cannot stop plus the save, printed by
``megareason plan`` for the recipe; a GraceTime shorter than that loses the step in progress (the latest
checkpoint stays; ``trainer.save_every_minutes`` bounds what is lost).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from pathlib import Path

from megareason.config.load import ConfigError
from megareason.config.schema import Config

GB = 1e9


@dataclass(frozen=True)
class LeadOptions:
    """Assumptions of the lead (the ``--checkpoint-write-gbs`` flag of ``megareason plan``)."""

    # Sustained write bandwidth of one node to trainer.output_dir's file system (GB/s). Parallel file
    # systems give roughly 1-5 GB/s per client node; measure yours (the driver logs each save's seconds).
    write_gb_s_per_node: float = 2.0
    # The distributed optimizer's gather of its state before a save, per rank (GB/s): measured 0.52 on an H200.
    gather_gb_s_per_rank: float = 0.5
    safety: float = 1.25  # the plan's step time is an estimate
    teardown_s: float = 120.0  # the driver's exit, Ray's teardown (slurm/ray_cluster.sh waits up to 60 s), requeue


@dataclass(frozen=True)
class Lead:
    step_s: float
    checkpoint_bytes: float
    nodes: int  # the nodes of the trainer's ranks, which write the checkpoint
    bytes_per_node: float  # what the busiest of them writes
    checkpoint_s: float  # gather_s + bytes_per_node at the write bandwidth of a node
    seconds: int  # the --signal lead: whole minutes
    options: LeadOptions
    gather_bytes_per_rank: float = 0.0  # the distributed optimizer's state each rank gathers before writing
    gather_s: float = 0.0

    def line(self) -> str:
        o, nodes = self.options, f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        write_s = self.checkpoint_s - self.gather_s
        gather = ""
        if self.gather_bytes_per_rank:
            gather = (f"its optimizer state gathered, {self.gather_bytes_per_rank / GB:.0f} GB per rank at "
                      f"{o.gather_gb_s_per_rank:g} GB/s = {self.gather_s:.0f} s, then ")
        return (f"pre-emption lead: a step {self.step_s:.0f} s + a checkpoint of {self.checkpoint_bytes / GB:.0f} GB "
                f"({gather}written by {nodes}, {self.bytes_per_node / GB:.0f} GB per node at "
                f"{o.write_gb_s_per_node:g} GB/s = {write_s:.0f} s), x {o.safety:g} + "
                f"{o.teardown_s:.0f} s teardown = #SBATCH --signal=B:USR1@{self.seconds}")


@dataclass(frozen=True)
class StopBound:
    """How long after a SIGTERM the checkpoint is committed: the longest piece of a step that cannot stop,
    then the save (``checkpoint_s``, as in ``Lead``)."""

    pieces: dict[str, float]  # each kind of piece that runs to its end once started -> its seconds
    checkpoint_s: float

    @property
    def longest(self) -> tuple[str, float]:
        return max(self.pieces.items(), key=lambda kv: kv[1])

    @property
    def seconds(self) -> float:
        return self.longest[1] + self.checkpoint_s

    def line(self) -> str:
        name, s = self.longest
        return (f"a pre-emption's SIGTERM: a checkpoint within {self.seconds:.0f} s, the longest piece that cannot "
                f"stop ({name}, {s:.0f} s) + the checkpoint ({self.checkpoint_s:.0f} s); the site's GraceTime must "
                f"be longer, or the step in progress is lost")


def stop_pieces(seconds: dict[str, float], cfg: Config, pp: int) -> dict[str, float]:
    """The pieces of a step that run to their end once started, from a plan's seconds per phase
    (``plan.seconds``): a log-prob pass's piece, a piece of the step's first optimizer step (``pieces`` of
    ``models/schedule.py``), and what follows that first optimizer step: the step's other updates and the
    weight refit. A generation stops between two engine steps, within ``STOP_POLL_S``."""
    from megareason.models.schedule import PIECES, PIECES_PIPELINED
    from megareason.rollout.records import STOP_POLL_S

    alg = cfg.algorithm
    n_pieces = PIECES if pp == 1 else PIECES_PIPELINED
    # the passes ``plan_time.add_seconds`` counts: old log-probs, the reference's, the critic's values
    passes = (alg.ppo_epochs > 1 or alg.mini_batches > 1) + (alg.kl_coef > 0) + (alg.name == "ppo")
    updates = alg.ppo_epochs * alg.mini_batches * (2 if alg.name == "ppo" else 1)
    training = seconds.get("training", 0.0)
    first = training / updates  # the actor's first optimizer step; the critic's follow it
    return {"a generation step": STOP_POLL_S,
            "a piece of a log-prob pass": seconds.get("logprobs", 0.0) / max(passes, 1) / n_pieces,
            "a piece of the first optimizer step": first / n_pieces,
            "the updates after the first and the weight refit": training - first + seconds.get("weight refit", 0.0)}


def plan_stop_bound(plan, cfg: Config, options: LeadOptions = LeadOptions()) -> StopBound:
    """The ``StopBound`` of a ``megareason plan`` result for its config. One step off-policy
    (trainer.max_staleness) finishes the step in progress: its batch in flight belongs to the next checkpoint."""
    lead = plan_lead(plan, cfg, options)
    if cfg.trainer.max_staleness:
        return StopBound({"a whole step, one step off-policy": lead.step_s}, lead.checkpoint_s)
    return StopBound(stop_pieces(plan.seconds, cfg, plan.pp), lead.checkpoint_s)


def checkpoint_bytes(cfg: Config, total_params: int, trainable_params: int) -> float:
    """Bytes of one checkpoint: the model in the training precision + Adam's state of the trainable params
    (fp32 main weights and two moments in bf16 training; two moments in fp32); twice with PPO's critic."""
    weights = (2 if cfg.trainer.precision == "bf16" else 4) * total_params
    adam = (12 if cfg.trainer.precision == "bf16" else 8) * trainable_params
    return (weights + adam) * (2 if cfg.algorithm.name == "ppo" else 1)


def trainable_params(cfg: Config, arch) -> int:
    """Parameters the optimizer holds state for (``arch``: the model's ``ModelArch``): every one, or with
    LoRA the adapters of the whole model (TP = PP = 1)."""
    from megareason.launch.plan_memory import lora_params_per_gpu, total_params

    if cfg.lora.enabled:
        return lora_params_per_gpu(arch, 1, 1, cfg.lora.rank, cfg.lora.targets)
    return total_params(arch)


def preemption_lead(step_s: float, ckpt_bytes: float, ranks: int, ranks_per_node: int,
                    options: LeadOptions = LeadOptions(), gather_bytes_per_rank: float = 0.0) -> Lead:
    """The lead for a step of ``step_s`` and a checkpoint of ``ckpt_bytes`` written by ``ranks`` trainer ranks,
    an equal share each, at most ``ranks_per_node`` of them on a node, after each rank has gathered
    ``gather_bytes_per_rank`` of optimizer state (the distributed optimizer's; 0 for the plain one)."""
    if options.write_gb_s_per_node <= 0:
        raise ConfigError(f"--checkpoint-write-gbs must be > 0, got {options.write_gb_s_per_node}")
    if options.gather_gb_s_per_rank <= 0:
        raise ConfigError(f"the optimizer-state gather rate must be > 0 GB/s, got {options.gather_gb_s_per_rank}")
    ranks_per_node = min(ranks_per_node, ranks)
    per_node = ckpt_bytes * ranks_per_node / ranks
    gather_s = gather_bytes_per_rank / (options.gather_gb_s_per_rank * GB)
    ckpt_s = gather_s + per_node / (options.write_gb_s_per_node * GB)
    seconds = 60 * math.ceil(((step_s + ckpt_s) * options.safety + options.teardown_s) / 60)
    return Lead(step_s, ckpt_bytes, math.ceil(ranks / ranks_per_node), per_node, ckpt_s, seconds, options,
                gather_bytes_per_rank, gather_s)


def gathered_optimizer_bytes(cfg: Config, trainable: int) -> float:
    """Optimizer state one rank gathers before a save: with the distributed optimizer, its replica's fp32 main
    weights and two Adam moments (12 bytes a trained parameter of the rank's TP x PP shard; with PPO the
    critic's after the actor's: the roles save one after the other), else none."""
    if not cfg.optim.use_distributed_optimizer:
        return 0.0
    shards = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    return 12 * trainable / shards * (2 if cfg.algorithm.name == "ppo" else 1)


def plan_lead(plan, cfg: Config, options: LeadOptions = LeadOptions()) -> Lead:
    """The lead of a ``megareason plan`` result (``plan.Plan``) for its config."""
    trainable = trainable_params(cfg, plan.arch)
    ckpt = checkpoint_bytes(cfg, plan.total_params, trainable)
    return preemption_lead(plan.step_seconds, ckpt, plan.trainer_gpus, plan.gpus_per_node, options,
                           gathered_optimizer_bytes(cfg, trainable))


def lead_for(args: argparse.Namespace) -> tuple[Lead, StopBound]:
    """The lead and the SIGTERM bound for ``megareason plan``'s arguments (the plan's own flags plus
    ``--checkpoint-write-gbs``)."""
    from megareason.config import load_config
    from megareason.launch.plan import PlanOptions, plan_config

    opt = PlanOptions(**{f.name: getattr(args, f.name) for f in fields(PlanOptions) if hasattr(args, f.name)})
    plan = plan_config(args.config, args.overrides, opt, args.model_shape)
    path = Path(args.config)
    is_file = path.suffix in (".yaml", ".yml") or "/" in args.config
    cfg = load_config(path.stem if is_file else args.config, args.overrides, path.parent if is_file else None)
    options = LeadOptions(write_gb_s_per_node=args.checkpoint_write_gbs)
    return plan_lead(plan, cfg, options), plan_stop_bound(plan, cfg, options)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-write-gbs", type=float, default=LeadOptions.write_gb_s_per_node,
                   help="checkpoint write bandwidth per node in GB/s, for the Slurm pre-emption lead "
                   "(--signal=B:USR1@LEAD) printed after the plan")
