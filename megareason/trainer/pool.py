"""Rollout engines on resources of their own (``rollout.placement: separate``).

``RolloutPool`` (driver side) starts ``rollout.num_engines`` engines of ``rollout.tensor_parallel_size`` Ray
actors each (``RolloutWorker``, one per vLLM rank, one device each; on CPU, a core of its own), each engine in a
placement group of its own on one node, beside the trainer's. At TP 1 an actor holds a whole ``VLLMEngine``; at
TP > 1 the engine's actors run vLLM's ``external_launcher`` executor over a group of their own (vLLM's Ray
executor would refuse the one-GPU bundles: vllm/v1/executor/ray_utils.py). On a cluster of several nodes whose
weights go by the broadcast, the engines go on nodes without the trainer's ranks (``engine_nodes``).
The engines never sleep: they generate while the trainer trains (``trainer.max_staleness``), so
``generate_async`` returns at once with a ``PendingGeneration``.

Weights reach them from the trainer's first rank (``RemoteEngines``, handed to it once the pool is up),
through vLLM's weight-transfer API, by ``rollout.weight_transfer``: ``shm``, the rank fills each bucket
once in tmpfs and every engine on the trainer's node loads it (``rollout.transfer``; the bucket's bytes
never cross Ray; engines on another node are refused); ``broadcast``, the rank broadcasts each bucket to
every engine on any node at once (``rollout.broadcast``: vLLM's NCCL engines on GPU, gloo on CPU).
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
    """One vLLM rank's process (a Ray actor) of a separate engine, and the RPCs the trainer's weight pushes
    call. At ``rollout.tensor_parallel_size`` 1 it holds a whole ``VLLMEngine``; at TP > 1 each of the
    engine's ranks is one of these, joined by a torch.distributed group of their own, running vLLM's
    ``external_launcher`` executor (the SPMD engine of ``rollout.colocated``): every rank gets the same calls,
    the pool keeps the first rank's completions."""

    def __init__(self, cfg: Config, index: int, cores: list[int] | None, rank: int = 0):
        from megareason.logs import name_worker

        tp = cfg.rollout.tensor_parallel_size
        name_worker("rollout", index * tp + rank)  # logs/rollout_rank0.log, rank 1, ... (engine-major)
        if cores:  # CPU: this engine's cores, apart from the trainer's
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
            os.sched_setaffinity(0, cores)
        self.cfg, self.index, self.rank, self.engine = cfg, index, rank, None
        if tp == 1:
            self._start()

    def address(self) -> tuple[str, int]:
        """The engine's first rank: its group's rendezvous store on this node; where it listens."""
        import ray

        from megareason.ports import rendezvous_store
        from megareason.trainer.workers import RENDEZVOUS_TIMEOUT

        host = ray.util.get_node_ip_address()
        self._store = rendezvous_store(host, self.cfg.rollout.tensor_parallel_size, RENDEZVOUS_TIMEOUT)
        return host, self._store.port

    def setup(self, master: tuple[str, int]) -> None:
        """TP > 1: join the engine's group at ``master`` (gloo on CPU, NCCL on GPU), then start this rank."""
        import torch
        import torch.distributed as dist

        from megareason.trainer.workers import RENDEZVOUS_TIMEOUT

        tp = self.cfg.rollout.tensor_parallel_size
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(tp), LOCAL_RANK="0")
        store = getattr(self, "_store", None) or dist.TCPStore(master[0], master[1], tp, is_master=False,
                                                               timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=self.rank,
                                world_size=tp, timeout=RENDEZVOUS_TIMEOUT)
        self._start()

    def _start(self) -> None:
        from dataclasses import replace as dc_replace

        from megareason.rollout import start_engine
        from megareason.settings import engine_settings

        settings = engine_settings(self.cfg)  # the weights arrive through vLLM's weight-transfer API
        settings.extra = {**settings.extra, "weight_transfer_config": {"backend": worker_backend(self.cfg)}}
        if self.cfg.rollout.tensor_parallel_size == 1:
            self.engine = start_engine(settings, self.index)
            return
        from megareason.rollout.colocated import ColocatedEngine

        self.engine = ColocatedEngine(settings)
        # Seeds of unseeded sampling differ between engines (``ColocatedEngine.generate``): this engine's
        # place among the pool's, not among the one-engine world it sees.
        self.engine.layout = dc_replace(self.engine.layout, engines=self.cfg.rollout.num_engines, engine=self.index)

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
        width = len(self.futures[0])
        parts = self.pool._get([f for ranks in self.futures for f in ranks], "generate")[::width]  # first ranks
        return [c for out, _ in parts for c in out], max(s for _, s in parts)


class RolloutPool:
    """``rollout.num_engines`` ``RolloutWorker`` actors in a placement group of their own (module docstring)."""

    def __init__(self, cfg: Config, on_gpu: bool, trainer_cores: int, trainer_nodes: frozenset[str] = frozenset()):
        """``trainer_nodes``: the Ray node ids of the trainer's ranks (``engine_nodes``)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from megareason.trainer.group import placement_ready

        r = cfg.rollout
        self.cfg, self.n, self.tp, self.failed = cfg, r.num_engines, r.tensor_parallel_size, False
        # One placement group per engine, a one-device bundle per vLLM rank, all on one node (STRICT_PACK):
        # vLLM's Ray executor refuses bundles of several GPUs (vllm/v1/executor/ray_utils.py), and an engine's
        # tensor-parallel all-reduce belongs inside a node.
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
        away = engine_nodes(cfg, bundle, trainer_nodes, ray.nodes())
        where = f"{self.tp} bundle(s) of {bundle} on one node" + (" without the trainer's ranks" if away else "")
        self.pgs = [placement_ready(placement_group([bundle] * self.tp, strategy="STRICT_PACK",
                                                    bundle_label_selector=[away] * self.tp if away else None),
                                    f"rollout engine {e}: {where}")
                    for e in range(self.n)]
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, (len(cores) - trainer_cores) // (self.n * self.tp))
        self.engines = [[ray.remote(RolloutWorker).options(
            num_cpus=0, num_gpus=1 if on_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[e], placement_group_bundle_index=k),
        ).remote(cfg, e, None if on_gpu else _engine_cores(cores, e * self.tp + k, per), k) for k in range(self.tp)]
            for e in range(self.n)]
        self.workers = [w for ranks in self.engines for w in ranks]  # engine-major: engine e's ranks together
        if self.tp > 1:
            masters = self._get([ranks[0].address.remote() for ranks in self.engines], "start")
            self._get([w.setup.remote(m) for ranks, m in zip(self.engines, masters, strict=True) for w in ranks],
                      "start")
        self.dtype = self._get([w.dtype.remote() for w in self.workers], "start")[0]
        nodes = self._get([w.node.remote() for w in self.workers], "start")
        log.info("rollout: %d separate engine(s) of %d x %s on %d Ray node(s) (%s), %s", self.n, self.tp, bundle,
                 len(set(nodes)), ", ".join(sorted({n[:12] for n in nodes})),
                 "none of them the trainer's" if not set(nodes) & trainer_nodes else "beside the trainer's ranks")

    def generate_async(self, prompts_token_ids: list[list[int]], sampling: Sampling) -> PendingGeneration:
        """Split the prompts over the engines in order (prompt i is sampled with seed + i, whichever engine
        serves it, as the colocated engines do) and start them; returns at once."""
        bounds = [round(i * len(prompts_token_ids) / self.n) for i in range(self.n + 1)]
        # Every rank of an engine gets the same call (SPMD); the first rank's completions are kept.
        futures = [[w.generate.remote(prompts_token_ids[a:b],
                                      sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + a))
                    for w in ranks]
                   for ranks, a, b in zip(self.engines, bounds[:-1], bounds[1:], strict=True)]
        return PendingGeneration(futures, self)

    def generate(self, prompts_token_ids: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        return self.generate_async(prompts_token_ids, sampling).result()[0]

    def stop_generating_on(self, path: str) -> None:
        self._get([w.stop_generating_on.remote(path) for w in self.workers], "stop_generating_on")

    def remote_engines(self) -> RemoteEngines:
        """What the trainer's first rank pushes weights through."""
        return RemoteEngines(self.workers, self.dtype, self.cfg.rollout)  # engine-major, as the offsets count

    def _get(self, futures: list, what: str) -> list:
        import ray

        from megareason.logs import last_worker_error
        from megareason.trainer.group import WorkerDied
        from megareason.trainer.run_dir import first_line

        def dead() -> list[int]:  # one call per rank: the dead one can be named
            return [k for k, w in enumerate(self.workers) if not _alive(w)] if len(futures) == len(self.workers) else []

        try:
            return ray.get(futures)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, GenerationStopped):
                raise e.cause from None
            # A rank whose peer died fails in the engine's next collective: name the dead one instead.
            gone = dead()
            if not gone:
                raise
            error = e
        except ray.exceptions.RayActorError as e:
            error, gone = e, dead()
        self.failed = True
        i = gone[0] if gone else next((k for k, f in enumerate(futures) if _died(f)), 0)
        engine = f"rollout engine {i // self.tp}" + (f" (vLLM rank {i % self.tp})" if self.tp > 1 else "")
        cause = last_worker_error("rollout", i)
        how = (first_line(error) if isinstance(error, ray.exceptions.RayActorError)
               else f"its process is gone (a peer then failed: {first_line(error)})")
        raise WorkerDied(f"{engine} died during {what}(): {how}"
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
        for pg in self.pgs:
            ray.util.remove_placement_group(pg)


def engine_nodes(cfg: Config, bundle: dict[str, int], trainer_nodes: frozenset[str], nodes: list[dict]) -> dict:
    """Ray's label selector for the engines' bundles: on a cluster of several nodes whose weights go by the
    collective broadcast, nodes without the trainer's ranks (``{"ray.io/node-id": "!in(...)"}``), as NeMo-RL
    splits its nodes between training and generation when generation is not colocated; else none (one node,
    or the tmpfs transfer, which needs the trainer's node). ``nodes``: ``ray.nodes()``. Raises ``ConfigError``
    when those nodes cannot hold ``rollout.num_engines`` whole engines."""
    r = cfg.rollout
    alive = [n for n in nodes if n.get("Alive")]
    if r.weight_transfer != "broadcast" or len(alive) < 2 or not trainer_nodes:
        return {}
    kind = "GPU" if "GPU" in bundle else "CPU"
    free = [n for n in alive if n["NodeID"] not in trainer_nodes]
    fit = sum(int(n.get("Resources", {}).get(kind, 0)) // r.tensor_parallel_size for n in free)
    if fit < r.num_engines:
        raise ConfigError(f"rollout.placement: separate on {len(alive)} Ray nodes: rollout.num_engines="
                          f"{r.num_engines} engines of rollout.tensor_parallel_size={r.tensor_parallel_size} {kind}s "
                          f"each go on the nodes without the trainer's ranks, which hold {fit}: give the job more "
                          "nodes, or fewer engines")
    return {"ray.io/node-id": f"!in({', '.join(sorted(trainer_nodes))})"}


class RemoteEngines:
    """The pool's engines as the trainer's first rank sees them (``PolicyWorker.sync_weights``): vLLM's
    trainer-side weight transfer, built on the first push: the tmpfs bucket (``rollout.transfer``,
    ``rollout.weight_transfer: shm``) or the collective broadcast (``rollout.broadcast``, ``broadcast``)."""

    def __init__(self, workers: list, dtype, rollout):
        self.workers, self.dtype, self.rollout, self.sender, self.pushes = workers, dtype, rollout, None, 0

    def check_node(self) -> None:
        """Refuse engines on another node when the weights go through this node's tmpfs."""
        import ray

        if self.rollout.weight_transfer == "broadcast":
            return
        here = ray.get_runtime_context().get_node_id()
        away = [i for i, node in enumerate(ray.get([w.node.remote() for w in self.workers])) if node != here]
        if away:
            raise ConfigError(f"rollout.placement: separate: engine(s) {away} run on another node than the trainer's "
                              "first rank, and rollout.weight_transfer: shm passes the weights through this node's "
                              "shared memory: set rollout.weight_transfer=broadcast (a collective broadcast to "
                              "engines on any node)")

    def update_weights(self, stream, shapes: dict[str, tuple[int, ...]], bucket_bytes: int) -> WeightUpdate:
        """Push the weights ``stream()`` yields (a fresh pass of the actor's HF tensors) into every engine."""
        if self.sender is None:
            self.sender = self._trainer_engine(stream, shapes, bucket_bytes)
            tp = self.rollout.tensor_parallel_size
            log.info("rollout: weights into %d separate engine(s) of %d rank(s) by %s (rollout.weight_transfer)",
                     len(self.workers) // tp, tp, type(self.sender).__name__)
        self.pushes += 1
        return self.sender.send_weights(weight_version=str(self.pushes))

    def _trainer_engine(self, stream, shapes, bucket_bytes: int):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from megareason.rollout import broadcast
        from megareason.rollout.transfer import HFWeightSource, PoolClient, ShmTrainerInitInfo

        tp = self.rollout.tensor_parallel_size
        client, source = PoolClient(self.workers, ranks_per_engine=tp), HFWeightSource(stream, shapes, self.dtype)
        if self.rollout.weight_transfer == "shm":
            return WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=0, bucket_bytes=bucket_bytes),
                                                             client=client, source=source)
        import ray

        info = broadcast.BroadcastTrainerInitInfo(
            rank=0, host=ray.util.get_node_ip_address(),
            engine_sizes=[tp] * (len(self.workers) // tp), bucket_bytes=bucket_bytes,
            timeout_s=broadcast.TIMEOUT_S)
        return broadcast.BroadcastTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def worker_backend(cfg: Config) -> str:
    """The backend each separate engine's vLLM workers build (``LLM(weight_transfer_config=...)``)."""
    from megareason.rollout.vllm_worker import BROADCAST_BACKEND, SHM_BACKEND

    return SHM_BACKEND if cfg.rollout.weight_transfer == "shm" else BROADCAST_BACKEND


def _engine_cores(cores: list[int], i: int, per: int) -> list[int]:
    """Engine ``i``'s cores on CPU: the last ``per`` cores for engine 0, the ``per`` before them for engine
    1, ...; the trainer's ranks keep the first ones (wraps around when there are too few)."""
    n = len(cores)
    return [cores[(n - (i + 1) * per + k) % n] for k in range(per)]


def _alive(worker) -> bool:
    import ray

    try:
        ray.get(worker.node.remote(), timeout=10)
    except Exception:
        return False
    return True


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
    elif world + r.num_engines * r.tensor_parallel_size > cpus:
        need = world + r.num_engines * r.tensor_parallel_size
        raise ConfigError(f"rollout.placement: separate: the trainer's {world} ranks + rollout.num_engines "
                          f"{r.num_engines} x rollout.tensor_parallel_size {r.tensor_parallel_size} vLLM ranks need "
                          f"{need} CPUs (one each), but the Ray cluster has {cpus}")
