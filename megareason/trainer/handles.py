"""The driver's typed handles on the worker groups: one method per worker call, typed results.

A ``WorkerGroup`` (``group.py``) runs a method on every rank of a role and returns the ranks' results;
these handles name the methods of ``PolicyWorker``/``CriticWorker`` (so a renamed worker method fails
at once) and turn the ranks' results into what the driver needs: the data-parallel replicas' rows
concatenated in row order, one ``TrainStats`` per optimizer step, the engines' completions in prompt
order. ``start_workers`` checks the cluster and starts the run's groups (``train`` and ``sft`` alike).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch

from megareason.config import Config, ConfigError
from megareason.data.records import TokenizedPrompt
from megareason.rollout.records import Completion, Sampling, WeightUpdate
from megareason.settings import compute_settings, engine_settings, lora_settings, optimizer_settings
from megareason.trainer.critic_worker import CriticWorker
from megareason.trainer.experience import Experience
from megareason.trainer.group import WorkerGroup, cluster_size
from megareason.trainer.pool import RolloutPool, check_pool
from megareason.trainer.stats import CriticStats, PolicyStats, SftStats
from megareason.trainer.workers import PolicySettings, PolicyWorker, WorkerSettings, colocated_rollout


class RoleHandle:
    """One role's worker group as the driver sees it: checkpoint save/load and shutdown."""

    def __init__(self, group: WorkerGroup):
        self.group, self.name = group, group.name

    def _call(self, method: Callable, *args) -> list:
        return self.group.call(method.__name__, *args)

    def _rows(self, method: Callable, exp: Experience) -> list:
        """Each replica's share of per-row outputs, in replica (= row) order."""
        return self.group.replicas(self._call(method, exp))

    def save(self, path: str, metadata: dict, asynchronous: bool = False) -> None:
        """Every rank writes its shard of the role's checkpoint into ``path`` (megatron dist_checkpointing);
        ``asynchronous``: in the background, committed by ``finish_saves``."""
        self._call(PolicyWorker.save, path, metadata, asynchronous)

    def finish_saves(self, blocking: bool) -> bool:
        """Commit the role's asynchronous saves every rank has written (``blocking``: wait for them); True
        when none is left."""
        return all(self._call(PolicyWorker.finish_saves, blocking))

    def load(self, path: str) -> None:
        """Every rank loads the role's checkpoint at ``path`` (any saved TP/PP layout)."""
        self._call(PolicyWorker.load, path)

    def stop_generating_on(self, path: str) -> None:
        """From now on the role's log-prob passes give up (``UpdateStopped``) once the file ``path`` exists."""
        self._call(CriticWorker.stop_generating_on, path)

    def memory_by_phase(self) -> dict[str, float]:
        """Each phase's GPU memory since the last call, the largest over the ranks (empty on CPU): the step's
        metrics, beside ``megareason plan``'s columns."""
        out: dict[str, float] = {}
        for rank in self._call(PolicyWorker.memory_by_phase):
            for key, value in rank.items():
                out[key] = max(out.get(key, 0.0), value)
        return {f"{self.name}/{k}": v for k, v in sorted(out.items())}

    def shutdown(self) -> None:
        self.group.shutdown()


class PolicyHandle(RoleHandle):
    """The actor (+ reference) ranks and their rollout engines: colocated on the ranks, or a separate
    ``RolloutPool`` (``pool``; its engines take the weights from the group's first rank)."""

    def __init__(self, group: WorkerGroup, pool: RolloutPool | None = None):
        super().__init__(group)
        self.pool = pool
        if pool is not None:
            self._call(PolicyWorker.attach_engines, pool.remote_engines())

    def generate(self, prompts: list[TokenizedPrompt], sampling: Sampling) -> list[list[Completion]]:
        """Split the prompts over the rollout engines (one per data-parallel replica, the colocated SPMD
        engines of rollout.tensor_parallel_size ranks each, or the separate pool's); completions in prompt
        order. Prompt i of the batch is sampled with seed + i, whichever engine serves it."""
        if self.pool is not None:
            return self.pool.generate([p.token_ids for p in prompts], sampling)
        leaders = self.group.engine_leaders()
        bounds = [round(i * len(prompts) / len(leaders)) for i in range(len(leaders) + 1)]
        parts = [[p.token_ids for p in prompts[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        samplings = [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + a)
                     for a in bounds[:-1]]
        results = self._call(PolicyWorker.generate, parts, samplings)
        return [c for i in leaders for c in results[i]]

    def generate_ids(self, contexts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """``generate`` for token-id contexts (the turns of multi-turn episodes)."""
        return self.generate([TokenizedPrompt(record=None, text="", token_ids=c) for c in contexts], sampling)

    def sleep_engine(self) -> None:
        self._call(PolicyWorker.sleep_engine)

    def stop_generating_on(self, path: str) -> None:
        """From now on a generate in progress gives up (``GenerationStopped``) once the file ``path`` exists,
        and so do the log-prob passes and a stoppable training pass (``UpdateStopped``)."""
        if self.pool is not None:
            self.pool.stop_generating_on(path)
        self._call(PolicyWorker.stop_generating_on, path)

    def sync_weights(self) -> list[WeightUpdate]:
        """The actor's weights into every engine (waking it); one record per engine."""
        return [u for u in self._call(PolicyWorker.sync_weights) if u is not None]

    def logprobs(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) [B, T] of ``exp``'s tokens under the actor's current weights."""
        logp, entropy = zip(*self._rows(PolicyWorker.logprobs, exp), strict=True)
        return torch.cat(logp), torch.cat(entropy)

    def ref_logprobs(self, exp: Experience) -> torch.Tensor:
        """[B, T] log-probs under the reference (the initial policy)."""
        return torch.cat(self._rows(PolicyWorker.ref_logprobs, exp))

    def train(self, exp: Experience, lr: float, on_policy: bool, stoppable: bool = False) -> PolicyStats:
        """One optimizer step on ``exp`` (a mini-batch; each replica trains its share); see
        ``PolicyWorker.train``."""
        return self._call(PolicyWorker.train, exp, lr, on_policy, stoppable)[0]

    def sft_train(self, exp: Experience, lr: float) -> SftStats:
        """One supervised optimizer step on ``exp``'s response tokens."""
        return self._call(PolicyWorker.sft_train, exp, lr)[0]


class CriticHandle(RoleHandle):
    """PPO's critic ranks."""

    def values(self, exp: Experience) -> torch.Tensor:
        """[B, T]: column t is the value of the state before token t."""
        return torch.cat(self._rows(CriticWorker.values, exp))

    def train(self, exp: Experience, lr: float) -> CriticStats:
        """One optimizer step of the value loss on ``exp`` (needs ``values_BT`` and ``returns_BT``)."""
        return self._call(CriticWorker.train, exp, lr)[0]


def check_cluster(cfg: Config) -> None:
    """Refuse a layout the Ray cluster cannot hold, before any worker starts."""
    world = _world(cfg)
    cpus, gpus = cluster_size()
    if cfg.rollout.placement == "separate":
        check_pool(cfg, cpus, gpus, world, on_gpu=torch.cuda.is_available() or gpus > 0)
    if torch.cuda.is_available() or gpus:
        if world > gpus:
            raise ConfigError(f"parallel: TP x PP x DP = {world} ranks but the Ray cluster has {gpus} GPUs")
    elif world > cpus:
        raise ConfigError(f"parallel: TP x PP x DP = {world} ranks but the Ray cluster has {cpus} CPUs "
                          "(one rank per CPU at most)")


def start_workers(cfg: Config, with_critic: bool) -> list[WorkerGroup]:
    """The policy group (and the critic's, colocated on the same ranks) after ``check_cluster``."""
    check_cluster(cfg)
    roles = [(PolicyWorker, policy_settings, "actor")] + ([(CriticWorker, critic_settings, "critic")]
                                                          if with_critic else [])
    # Colocated: the roles share each GPU; on CPU the ranks share the cores (the roles take turns).
    gpus = 1.0 / len(roles) if torch.cuda.is_available() else 0
    threads = max(1, (os.cpu_count() or 1) // _world(cfg))
    if cfg.rollout.placement == "separate" and not gpus:  # the separate engines' cores are theirs
        threads = max(1, ((os.cpu_count() or 1) - cfg.rollout.num_engines) // _world(cfg))
    # The critic's ranks first: its state is built (and with trainer.offload_optimizer moved to host memory)
    # before the policy's vLLM engine takes its share of each GPU (launch/ledger.py, start-up).
    groups = {name: WorkerGroup(cls, cfg, settings(cfg), name, gpus, threads) for cls, settings, name in roles[::-1]}
    return [groups[name] for _, _, name in roles]


def start_rollouts(cfg: Config, groups: list[WorkerGroup]) -> RolloutPool | None:
    """rollout.placement: separate: the rollout engines' pool (``trainer.pool``), away from the nodes of
    ``groups`` (the trainer's) on a cluster of several nodes; colocated: None (the policy's ranks hold the
    engines)."""
    if cfg.rollout.placement != "separate":
        return None
    return RolloutPool(cfg, on_gpu=torch.cuda.is_available(), trainer_cores=_world(cfg),
                       trainer_nodes=frozenset(node for g in groups for node in g.nodes))


def _world(cfg: Config) -> int:
    p = cfg.parallel
    return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size


def worker_settings(cfg: Config, lr: float) -> WorkerSettings:
    """What a rank of a trained role receives: its model, layout, precision, optimizer at ``lr``, LoRA, micro-
    batching and loss settings (``WorkerSettings``); the critic's."""
    p, t = cfg.parallel, cfg.trainer
    return WorkerSettings(model_path=cfg.model.path, tensor_parallel=p.tensor_model_parallel_size,
                          pipeline_parallel=p.pipeline_model_parallel_size,
                          expert_parallel=p.expert_model_parallel_size, sequence_parallel=p.sequence_parallel,
                          seed=t.seed, local_ray=t.ray_address == "", optimizer=optimizer_settings(cfg, lr),
                          compute=compute_settings(cfg), lora=lora_settings(cfg),
                          micro_batch_tokens=t.micro_batch_tokens, share_prompt_prefix=t.share_prompt_prefix,
                          max_tokens=cfg.rollout.max_tokens, offload_optimizer=t.offload_optimizer,
                          algorithm=cfg.algorithm)


def critic_settings(cfg: Config) -> WorkerSettings:
    return worker_settings(cfg, cfg.optim.critic_lr)


def policy_settings(cfg: Config) -> PolicySettings:
    """The policy's: ``worker_settings`` at ``optim.lr``, plus its rollout engines and weight sync."""
    r = cfg.rollout
    return PolicySettings(**vars(worker_settings(cfg, cfg.optim.lr)), temperature=r.temperature,
                          engine=engine_settings(cfg), placement=r.placement,
                          colocated_engines=colocated_rollout(r.placement, r.tensor_parallel_size),
                          weight_sync_bucket_mb=cfg.trainer.weight_sync_bucket_mb,
                          with_reference=cfg.algorithm.kl_coef > 0 and not cfg.lora.enabled)
