"""Ray: start or join a cluster and place a role's worker processes on it.

A ``WorkerGroup`` is ``tp x pp x dp`` Ray actors of one worker class. ``call`` runs a method on every
rank and returns the results in rank order; ``replicas`` keeps the result of each data-parallel
replica's first rank (where a replica's outputs are complete), in replica order.

Placement is explicit: one placement-group bundle per rank (a CPU on CPU, a GPU on GPU), shared by every
role's rank i, so colocated roles (PPO's actor and critic) sit in the same process slot. Ray reserves the
bundles on nodes in no particular order (a PACK group's equal bundles are sorted unstably, so bundle i and
i+1 may sit on different nodes), so ranks are not bundle indices: ``ranks_to_bundles`` reads which node
holds each bundle and gives consecutive ranks the bundles of one node, so every tensor-parallel group (and
every colocated vLLM engine) lies on one node, and refuses a cluster where one cannot.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from megareason.config.load import ConfigError
from megareason.config.schema import Config
from megareason.logs import last_worker_error
from megareason.rollout.records import GenerationStopped
from megareason.trainer.run_dir import RunError, first_line

log = logging.getLogger(__name__)


@contextmanager
def ray_session(address: str, num_cpus: int | None = None) -> Iterator[None]:
    """Connect to Ray for the duration of the block. ``address`` empty: a private local cluster on
    127.0.0.1, stopped on exit; otherwise join the running cluster at ``address`` ("auto" finds the
    one on this node) and leave it running."""
    import ray

    if ray.is_initialized():
        yield
        return
    from megareason.logs import worker_runtime_env

    # The workers import megareason from the same place as the driver; their output goes to the run
    # folder's logs/ when the driver's does (megareason/logs.py).
    env = worker_runtime_env({
        "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        # vLLM's per-request INFO lines would drown the training log.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")})
    if not address:
        # One port block for this run's services on this machine (megareason/ports.py); on a cluster each
        # node's raylet passes its own (slurm/ray_cluster.sh).
        from megareason.ports import PORT_BASE_ENV, block_base

        os.environ.setdefault(PORT_BASE_ENV, str(block_base()))
        env["env_vars"][PORT_BASE_ENV] = os.environ[PORT_BASE_ENV]
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        # address="local": always a new private cluster, never one a `ray start` left on this machine.
        # No idle workers started ahead: none would match this job's runtime environment (its env_vars), so
        # each would cost a Python start-up for nothing (slurm/ray_cluster.sh turns them off on a cluster too).
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus or os.cpu_count(),
                 include_dashboard=False, runtime_env=env, log_to_driver=True, configure_logging=False,
                 _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
    try:
        yield
    finally:
        ray.shutdown()


def _package_root() -> str:
    import megareason

    return os.path.dirname(os.path.dirname(os.path.abspath(megareason.__file__)))


def cluster_size() -> tuple[int, int]:
    """(CPUs, GPUs) the cluster has."""
    import ray

    res = ray.cluster_resources()
    return int(res.get("CPU", 0)), int(res.get("GPU", 0))


def ranks_to_bundles(bundle_nodes: Sequence[str], block: int, what: str) -> list[int]:
    """The bundle each rank runs in (``result[rank]``), given the node that holds each bundle
    (``bundle_nodes[bundle]``), such that every ``block`` consecutive ranks starting at a multiple of
    ``block`` (a tensor-parallel group, a colocated engine) hold bundles of one node. Bundles are taken node
    by node (nodes in the order of their first bundle, each node's bundles in index order), as NeMo-RL's
    ``RayVirtualCluster`` sorts them; on one node this is the identity. Raises ``ConfigError`` naming
    ``what`` (the fields that set ``block``) when a node holds a number of bundles that is not a multiple of
    ``block``: then some group must span two nodes, whatever the order."""
    by_node: dict[str, list[int]] = {}
    for bundle, node in enumerate(bundle_nodes):
        by_node.setdefault(node, []).append(bundle)
    if any(len(b) % block for b in by_node.values()):
        counts = ", ".join(f"{len(b)} on node {node[:12]}" for node, b in by_node.items())
        raise ConfigError(f"{what}: each group of {block} consecutive ranks must lie on one node, but Ray placed "
                          f"the {len(bundle_nodes)} ranks {counts}: give every node a multiple of {block} GPUs")
    return [bundle for bundles in by_node.values() for bundle in bundles]


def node_block(cfg: Config) -> tuple[int, str]:
    """How many consecutive ranks must share a node (Megatron's TP group and, with colocated engines, vLLM's
    TP group: both are runs of consecutive ranks), and the fields that set it."""
    from megareason.trainer.workers import colocated_rollout

    tp = cfg.parallel.tensor_model_parallel_size
    if not colocated_rollout(cfg.rollout.placement, cfg.rollout.tensor_parallel_size):
        return tp, f"parallel.tensor_model_parallel_size={tp}"
    vtp = cfg.rollout.tensor_parallel_size
    return math.lcm(tp, vtp), (f"parallel.tensor_model_parallel_size={tp} with "
                               f"rollout.tensor_parallel_size={vtp}")


@dataclass(frozen=True)
class Placement:
    """A placement group of one bundle per rank, and the bundle of each rank (``ranks_to_bundles``)."""

    pg: object
    bundles: list[int]

    def strategy(self, rank: int):
        """Ray's scheduling strategy that puts an actor in ``rank``'s bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.bundles[rank])


# (Ray job id, ranks, on GPU, block) -> the placement every role of that driver shares.
_placements: dict[tuple[str, int, bool, int], Placement] = {}
_PLACEMENT_TIMEOUT_S = 300.0


def rank_placement(world: int, gpus: bool, block: int = 1, what: str = "") -> Placement:
    """The placement group with one bundle per rank ({"GPU": 1} or {"CPU": 1}) and the bundle of each rank,
    created on first use by this Ray job and reused by its other roles; raises ``RuntimeError`` if the
    cluster cannot hold it, ``ConfigError`` (before any worker starts) if Ray spread it so that a group of
    ``block`` consecutive ranks cannot lie on one node (``ranks_to_bundles``)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    key = (ray.get_runtime_context().get_job_id(), world, gpus, block)
    if key not in _placements:
        pg = placement_group([{"GPU": 1} if gpus else {"CPU": 1}] * world, strategy="PACK")
        placement_ready(pg, f"{world} ranks of 1 {'GPU' if gpus else 'CPU'} each")
        # Which node holds each bundle, once the group is reserved: Ray 2.60's GCS table
        # (python/ray/_private/state.py, placement_group_table: "bundles_to_node_id", bundle index -> node id).
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        try:
            bundles = ranks_to_bundles([nodes[i] for i in range(world)], block, what)
        except ConfigError:
            ray.util.remove_placement_group(pg)
            raise
        _placements[key] = Placement(pg, bundles)
    return _placements[key]


def placement_ready(pg, what: str):
    """``pg`` once Ray has reserved it; raises ``RuntimeError`` (and removes it) when the cluster cannot
    hold ``what`` within the time limit."""
    import ray

    try:
        ray.get(pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"Ray could not place {what} within {_PLACEMENT_TIMEOUT_S:g} s; cluster resources: "
                           f"{ray.cluster_resources()}") from None
    return pg


def _node_of(_actor) -> tuple[str, str]:
    """(IP, node id) of the Ray node this actor runs on (called through ``__ray_call__``)."""
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


class WorkerDied(RunError):
    """A worker process of a group died (killed, out of memory, or its vLLM engine died) during a call."""


class WorkerGroup:
    """``tp x pp x dp`` Ray actors of one worker class (a role), one per placement bundle, set up with
    torch.distributed and megatron-core's parallel groups (rendezvous at rank 0's address). The driver
    reaches it through the typed handles of ``trainer/handles.py``."""

    def __init__(self, worker_cls, cfg: Config, settings, name: str, gpus_per_worker: float, threads: int):
        """``settings``: what each worker receives (``workers.WorkerSettings``); ``cfg`` places the ranks."""
        import ray

        p = cfg.parallel
        self.world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
        self.name, self.worker_cls = name, worker_cls
        placement = rank_placement(self.world, gpus_per_worker > 0, *node_block(cfg))
        # num_cpus=0: on CPU the bundle's CPU is the rank's slot, shared by the colocated roles, and the
        # bundle still pins the actor to its node. On GPU the roles split the bundle's GPU.
        self.failed = False  # a call failed on some rank (``call``)
        self.workers = [ray.remote(worker_cls).options(
            num_cpus=0, num_gpus=gpus_per_worker, scheduling_strategy=placement.strategy(rank),
        ).remote(settings, rank, self.world) for rank in range(self.world)]
        # A rank that dies while the group starts is reported as in ``call``: by rank, with its last error.
        nodes = self._results([w.__ray_call__.remote(_node_of) for w in self.workers], "start")
        self.nodes = [node for _, node in nodes]  # each rank's Ray node id
        log.info("%s: ranks on %d Ray node(s): %s", name, len({node for _, node in nodes}),
                 ", ".join(f"rank {r} -> {ip} ({node[:12]})" for r, (ip, node) in enumerate(nodes)))
        master = self._results([self.workers[0].address.remote()], "address")[0]
        log.info("%s: %d workers, rendezvous at %s:%d", name, self.world, *master)
        ranks = self._results([w.setup.remote(master, threads) for w in self.workers], "setup")
        self.first_of_replica = [i for i, (_, tp, pp) in enumerate(ranks) if tp == 0 and pp == 0]
        self.first_of_replica.sort(key=lambda i: ranks[i][0])
        self._engine_leaders: list[int] | None = None

    def call(self, method: str, *args) -> list:
        """Run ``method(*args)`` on every rank (every rank must take part: the methods run collectives);
        the ranks' results in rank order."""
        import ray

        # One object-store copy of each large argument, shared by all ranks.
        refs = [ray.put(a) for a in args]
        return self._results([getattr(w, method).remote(*refs) for w in self.workers], method)

    def _results(self, futures: list, method: str) -> list:
        """The results of ``futures`` (one per rank, from rank 0) in rank order, failing at the first rank
        that fails: its peers may wait on it in a collective forever. A rank that died is a ``WorkerDied``
        naming the rank, ``method`` and the rank's last error."""
        import ray

        pending = list(futures)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                self.failed = True
                rank = futures.index(done[0])
                role = self.worker_cls.__name__.removesuffix("Worker").lower()
                cause = last_worker_error(role, rank)  # e.g. which vLLM engine core died
                raise WorkerDied(f"{self.name} rank {rank} died during {method}(): {first_line(e)}"
                                 f"{f'; its last error: {cause}' if cause else ''} (its log: "
                                 f"logs/{role}_rank{rank}.log in the run folder)") from None
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, GenerationStopped):  # the run is stopping: the group is fine
                    raise e.cause from None
                self.failed = True
                if isinstance(e.cause, RunError):  # its message is the report (a weight sync that failed on a rank)
                    raise e.cause from None
                raise
            except Exception:
                self.failed = True
                raise
        return ray.get(futures)

    def replicas(self, results: list) -> list:
        """The results of each data-parallel replica's first rank (TP 0, PP 0), in replica order."""
        return [results[i] for i in self.first_of_replica]

    def engine_leaders(self) -> list[int]:
        """Policy groups: the rank that returns each rollout engine's outputs, in engine order (the first
        rank of each data-parallel replica, or of each colocated SPMD engine; ``PolicyWorker.rollout_engine``)."""
        if self._engine_leaders is None:
            engine = self.call("rollout_engine")
            self._engine_leaders = sorted((i for i, e in enumerate(engine) if e is not None), key=lambda i: engine[i])
        return self._engine_leaders

    def shutdown(self) -> None:
        import ray

        try:  # after a failure the survivors may be stuck in a collective: no graceful stop to wait for
            ray.get([w.shutdown.remote() for w in self.workers], timeout=5 if self.failed else 120)
        except Exception as e:  # a worker that already died has nothing to stop
            log.warning("%s: shutdown: %s", self.name, e)
        for w in self.workers:
            ray.kill(w)
