"""Rollout engines on resources of their own (``rollout.placement: separate``).

``RolloutPool`` (driver side) starts ``rollout.num_engines`` Ray actors, ``RolloutWorker``, in a placement
group beside the trainer's: each holds a whole ``VLLMEngine`` of one device (on CPU, one core of its own):
``validate_training`` refuses ``rollout.tensor_parallel_size`` > 1 here, since vLLM would start its Ray
executor in this placement group, which refuses bundles of more than one GPU (vllm/v1/executor/ray_utils.py).
The engines never sleep: they generate while the trainer trains (``trainer.max_staleness``), so
``generate_async`` returns at once with a ``PendingGeneration``.

Weights reach them from the trainer's first rank (``RemoteEngines``, handed to it once the pool is up):
the rank fills each bucket once in tmpfs, every engine loads it through an RPC into its actor
(``rollout.engine.push_weights``; the bucket's bytes never cross Ray). That needs the engines on the
trainer's node; engines on other nodes need vLLM's NCCL weight transfer (``WeightTransferConfig``), which
is not built yet: the pool refuses them with that message.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, replace

from megareason.config import Config, ConfigError
from megareason.rollout.records import Completion, GenerationStopped, Sampling, WeightUpdate

log = logging.getLogger(__name__)


class RolloutWorker:
    """One engine's process (a Ray actor): a ``VLLMEngine`` and the RPCs the trainer's weight pushes call."""

    def __init__(self, cfg: Config, index: int, cores: list[int] | None):
        from megareason.logs import name_worker

        name_worker("rollout", index)  # logs/rollout_rank0.log
        if cores:  # CPU: this engine's cores, apart from the trainer's
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
            os.sched_setaffinity(0, cores)
        from megareason.rollout import start_engine
        from megareason.rollout.vllm_worker import SHM_BACKEND
        from megareason.settings import engine_settings

        settings = engine_settings(cfg)  # the weights arrive through vLLM's weight-transfer API
        settings.extra = {**settings.extra, "weight_transfer_config": {"backend": SHM_BACKEND}}
        self.index, self.engine = index, start_engine(settings, index)

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def dtype(self):
        return self.engine.dtype

    def generate(self, prompts_token_ids: list[list[int]], sampling: Sampling) -> tuple[list[list[Completion]], float]:
        """The completions and the seconds the engine spent on them."""
        start = time.perf_counter()
        out = self.engine.generate(prompts_token_ids, sampling, use_tqdm=False)
        return out, time.perf_counter() - start

    def stop_generating_on(self, path: str) -> None:
        """A generate in progress gives up (``GenerationStopped``) once the file ``path`` exists."""
        self.engine.should_stop = functools.partial(os.path.exists, path)

    # vLLM's weight-sync control plane (``VLLMWeightSyncClient``'s methods; ``rollout.transfer.PoolClient``)
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self) -> None:
        self.engine.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.engine.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update; cached prefixes were computed with the old weights: dropped."""
        self.engine.llm.collective_rpc("finish_weight_update")
        self.engine.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


@dataclass
class PendingGeneration:
    """A ``generate`` in flight on the pool's engines; ``result()`` waits for it."""

    futures: list
    pool: RolloutPool

    def result(self) -> tuple[list[list[Completion]], float]:
        """(completions in prompt order, the slowest engine's generation seconds)."""
        parts = self.pool._get(self.futures, "generate")
        return [c for out, _ in parts for c in out], max(s for _, s in parts)


class RolloutPool:
    """``rollout.num_engines`` ``RolloutWorker`` actors in a placement group of their own (module docstring)."""

    def __init__(self, cfg: Config, on_gpu: bool, trainer_cores: int):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from megareason.trainer.group import placement_ready

        r = cfg.rollout
        self.n, self.failed = r.num_engines, False
        bundle = {"GPU": r.tensor_parallel_size, "CPU": 1} if on_gpu else {"CPU": 1}
        self.pg = placement_ready(placement_group([bundle] * self.n, strategy="PACK"),
                                  f"{self.n} rollout engines of {bundle}")
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, (len(cores) - trainer_cores) // self.n)
        self.workers = [ray.remote(RolloutWorker).options(
            num_cpus=0, num_gpus=r.tensor_parallel_size if on_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(cfg, i, None if on_gpu else _engine_cores(cores, i, per)) for i in range(self.n)]
        self.dtype = self._get([w.dtype.remote() for w in self.workers], "start")[0]
        log.info("rollout: %d separate engine(s) of %s", self.n, bundle)

    def generate_async(self, prompts_token_ids: list[list[int]], sampling: Sampling) -> PendingGeneration:
        """Split the prompts over the engines in order (prompt i is sampled with seed + i, whichever engine
        serves it, as the colocated engines do) and start them; returns at once."""
        bounds = [round(i * len(prompts_token_ids) / self.n) for i in range(self.n + 1)]
        futures = [w.generate.remote(prompts_token_ids[a:b],
                                     sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + a))
                   for w, a, b in zip(self.workers, bounds[:-1], bounds[1:], strict=True)]
        return PendingGeneration(futures, self)

    def generate(self, prompts_token_ids: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        return self.generate_async(prompts_token_ids, sampling).result()[0]

    def stop_generating_on(self, path: str) -> None:
        self._get([w.stop_generating_on.remote(path) for w in self.workers], "stop_generating_on")

    def remote_engines(self) -> RemoteEngines:
        """What the trainer's first rank pushes weights through."""
        return RemoteEngines(self.workers, self.dtype)

    def _get(self, futures: list, what: str) -> list:
        import ray

        from megareason.logs import last_worker_error
        from megareason.trainer.group import WorkerDied
        from megareason.trainer.run_dir import first_line

        try:
            return ray.get(futures)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, GenerationStopped):
                raise e.cause from None
            raise
        except ray.exceptions.RayActorError as e:
            self.failed = True
            i = next((k for k, f in enumerate(futures) if _died(f)), 0)
            cause = last_worker_error("rollout", i)
            raise WorkerDied(f"rollout engine {i} died during {what}(): {first_line(e)}"
                             f"{f'; its last error: {cause}' if cause else ''} (its log: logs/rollout_rank{i}.log "
                             "in the run folder)") from None

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=5 if self.failed else 120)
        except Exception as e:  # an engine that already died has nothing to stop
            log.warning("rollout: shutdown: %s", e)
        for w in self.workers:
            ray.kill(w)
        ray.util.remove_placement_group(self.pg)


class RemoteEngines:
    """The pool's engines as the trainer's first rank sees them (``PolicyWorker.sync_weights``): vLLM's
    trainer-side weight transfer (``rollout.transfer``), built on the first push."""

    def __init__(self, workers: list, dtype):
        self.workers, self.dtype, self.sender, self.pushes = workers, dtype, None, 0

    def check_node(self) -> None:
        """Refuse engines on another node: the tmpfs buckets are this node's memory."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        away = [i for i, node in enumerate(ray.get([w.node.remote() for w in self.workers])) if node != here]
        if away:
            raise ConfigError(f"rollout.placement: separate: engine(s) {away} run on another node than the trainer's "
                              "first rank; weights reach them through this node's shared memory only (vLLM's NCCL "
                              "weight transfer across nodes is not built yet): give the job one node, or use "
                              "rollout.placement: colocated")

    def update_weights(self, stream, shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> WeightUpdate:
        """Push the weights ``stream()`` yields (a fresh pass of the actor's HF tensors) into every engine."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from megareason.rollout.transfer import HFWeightSource, PoolClient, ShmTrainerInitInfo

        if self.sender is None:
            self.sender = WeightTransferTrainerFactory.trainer_init(
                ShmTrainerInitInfo(rank=0, bucket_bytes=bucket_bytes), client=PoolClient(self.workers),
                source=HFWeightSource(stream, shapes, self.dtype))
        self.pushes += 1
        return self.sender.send_weights(weight_version=str(self.pushes))


def _engine_cores(cores: list[int], i: int, per: int) -> list[int]:
    """Engine ``i``'s cores on CPU: the last ``per`` cores for engine 0, the ``per`` before them for engine
    1, ...; the trainer's ranks keep the first ones (wraps around when there are too few)."""
    n = len(cores)
    return [cores[(n - (i + 1) * per + k) % n] for k in range(per)]


def _died(future) -> bool:
    import ray

    try:
        ray.get(future, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:
        return False
    return False


def check_pool(cfg: Config, cpus: int, gpus: int, world: int, on_gpu: bool) -> None:
    """Refuse a separate pool the cluster cannot hold beside the trainer's ``world`` ranks."""
    r = cfg.rollout
    if on_gpu:
        need = world + r.num_engines * r.tensor_parallel_size
        if need > gpus:
            raise ConfigError(f"rollout.placement: separate: the trainer's {world} GPUs + rollout.num_engines "
                              f"{r.num_engines} x rollout.tensor_parallel_size {r.tensor_parallel_size} = {need} GPUs, "
                              f"but the Ray cluster has {gpus}")
    elif world + r.num_engines > cpus:
        raise ConfigError(f"rollout.placement: separate: the trainer's {world} ranks + rollout.num_engines "
                          f"{r.num_engines} engines need {world + r.num_engines} CPUs (one each), but the Ray "
                          f"cluster has {cpus}")
