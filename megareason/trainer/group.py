"""Ray: start or join a cluster and place a role's worker processes on it.

A ``WorkerGroup`` is ``tp x pp x dp`` Ray actors of one worker class. ``call`` runs a method on every
rank and returns the results in rank order; ``replicas`` keeps the result of each data-parallel
replica's first rank (where a replica's outputs are complete), in replica order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from megareason.config.schema import Config

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
    # The workers import megareason from the same place as the driver.
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")])),
                        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        # vLLM's per-request INFO lines would drown the training log.
                        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        # address="local": always a new private cluster, never one a `ray start` left on this machine.
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 runtime_env=env, log_to_driver=True, configure_logging=False)
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


class WorkerGroup:
    def __init__(self, worker_cls, cfg: Config, name: str, gpus_per_worker: float, threads: int):
        import ray

        p = cfg.parallel
        self.world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
        self.name = name
        remote = ray.remote(worker_cls).options(num_cpus=0, num_gpus=gpus_per_worker)
        self.workers = [remote.remote(cfg, rank, self.world) for rank in range(self.world)]
        master = ray.get(self.workers[0].address.remote())
        log.info("%s: %d workers, rendezvous at %s:%d", name, self.world, *master)
        ranks = ray.get([w.setup.remote(master, threads) for w in self.workers])
        self.first_of_replica = [i for i, (_, tp, pp) in enumerate(ranks) if tp == 0 and pp == 0]
        self.first_of_replica.sort(key=lambda i: ranks[i][0])

    def call(self, method: str, *args) -> list:
        import ray

        # One object-store copy of each large argument, shared by all ranks.
        refs = [ray.put(a) for a in args]
        return ray.get([getattr(w, method).remote(*refs) for w in self.workers])

    def replicas(self, results: list) -> list:
        return [results[i] for i in self.first_of_replica]

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=120)
        except Exception as e:  # a worker that already died has nothing to stop
            log.warning("%s: shutdown: %s", self.name, e)
        for w in self.workers:
            ray.kill(w)
