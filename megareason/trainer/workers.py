"""The processes the driver drives: one per rank of a model-parallel role, placed by Ray (``group.py``).

``PolicyWorker`` holds the actor (trained), the reference (when the KL coefficient is > 0) and its share
of a vLLM engine that generates with the actor's weights (on GPU, vLLM sleeps while Megatron trains):
with ``rollout.tensor_parallel_size`` > 1 every rank holds one TP rank of a colocated SPMD engine of that
many consecutive ranks (``rollout.colocated``); at 1, the first rank of each data-parallel replica holds a
whole engine (its own vLLM engine process, fed through shared-memory buckets). ``CriticWorker``
(``critic_worker.py``) holds the critic (PPO). Every rank of a group receives the same calls; each
data-parallel replica works on its share of the step's rows (``share``), and the first rank of each
replica returns that share's results.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from megareason.config.schema import AlgorithmConfig
from megareason.models.build import ComputeSettings
from megareason.models.lora import LoRASettings
from megareason.models.memory import record_phases
from megareason.models.schedule import forward_outputs
from megareason.models.train import OptimizerSettings
from megareason.rollout.records import EngineSettings, WeightUpdate
from megareason.trainer.experience import Experience, pack_experience, unpack_to_rows
from megareason.trainer.stats import PolicyStats, SftStats, TrainStats

RENDEZVOUS_TIMEOUT = timedelta(minutes=10)  # every rank joins the store within this (torch's default)


@dataclass(frozen=True)
class WorkerSettings:
    """What one rank of a trained role uses, built once on the driver (``handles.worker_settings``): the run's
    ``Config`` stays in the driver's process."""

    model_path: str  # model.path (a Hub id resolves from the cache the driver filled)
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int
    sequence_parallel: bool
    seed: int
    local_ray: bool  # a local Ray session: the rendezvous listens on loopback
    optimizer: OptimizerSettings  # at the role's learning rate (each update sets the step's)
    compute: ComputeSettings
    lora: LoRASettings | None
    micro_batch_tokens: int
    share_prompt_prefix: bool
    max_tokens: int  # rollout.max_tokens: the losses' constant for seq-mean-token-sum-norm
    offload_optimizer: bool
    algorithm: AlgorithmConfig  # the loss functions' settings


@dataclass(frozen=True)
class PolicySettings(WorkerSettings):
    """The policy's ranks: also the rollouts' temperature (log-probs are of logits / temperature), their
    engines and the weight sync."""

    temperature: float
    engine: EngineSettings
    placement: str  # rollout.placement
    colocated_engines: bool  # SPMD engines over the ranks (rollout TP > 1, colocated): ``colocated_rollout``
    weight_sync_bucket_mb: int
    with_reference: bool  # a frozen reference copy (KL coefficient > 0, full fine-tuning)


def on_gpu() -> bool:
    """Whether this process computes on a GPU: there the reference waits in host memory between uses."""
    return torch.cuda.is_available()


def share(n: int, dp: int, dp_rank: int) -> slice:
    """Replica ``dp_rank``'s contiguous share of ``n`` rows; shares differ by at most one row (RARO's
    row count varies from step to step)."""
    if n < dp:
        raise ValueError(f"{n} rows cannot be shared by {dp} data-parallel replicas")
    return slice(n * dp_rank // dp, n * (dp_rank + 1) // dp)


def colocated_rollout(placement: str, rollout_tp: int) -> bool:
    """Whether the policy's engines are SPMD engines spread over the trainer's ranks (vLLM TP > 1)."""
    return placement == "colocated" and rollout_tp > 1


class _Worker:
    """Rendezvous first (``address``), then ``setup`` with rank 0's address: torch.distributed and
    megatron-core's parallel groups for this role."""

    stop_path: str | None = None  # the driver's stop file (``stop_generating_on``)

    def __init__(self, settings: WorkerSettings, rank: int, world: int):
        from megareason.logs import name_worker

        self.settings, self.rank, self.world = settings, rank, world
        name_worker(type(self).__name__.removesuffix("Worker").lower(), rank)  # logs/policy_rank0.log

    def address(self) -> tuple[str, int]:
        """Rank 0: start the group's rendezvous store on this node, at a port of the run's block below the
        ephemeral range (megareason/ports.py), and return where it listens."""
        from megareason.ports import rendezvous_store

        # A local Ray session lives on loopback; on a cluster, the address Ray reached this node at
        # (gethostbyname(gethostname()) can resolve to 127.0.1.1 there).
        if self.settings.local_ray:
            host = "127.0.0.1"
        else:
            import ray

            host = ray.util.get_node_ip_address()
        self._store = rendezvous_store(host, self.world, RENDEZVOUS_TIMEOUT)
        return host, self._store.port

    def setup(self, master: tuple[str, int], threads: int) -> tuple[int, int, int]:
        """Join the process group at ``master`` and build the role; returns (dp_rank, tp_rank, pp_rank)."""
        import torch.distributed as dist

        from megareason.models.parallel import init_parallel

        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK="0")
        # NVLink SHARP off unless the site turns it on: an NVLS communicator takes over 1 GiB of each GPU
        # (NVIDIA/nccl#864), which colocated vLLM has no room for; NeMo's launcher sets the same.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        store = getattr(self, "_store", None) or dist.TCPStore(master[0], master[1], self.world, is_master=False,
                                                               timeout=RENDEZVOUS_TIMEOUT)
        if not torch.cuda.is_available():
            torch.set_num_threads(threads)
        s = self.settings
        self.layout = init_parallel(s.tensor_parallel, s.pipeline_parallel, seed=s.seed, ep=s.expert_parallel,
                                    store=store)
        self._build()
        return self.layout.dp_rank, self.layout.tp_rank, self.layout.pp_rank

    def _build(self) -> None:
        raise NotImplementedError

    def _share(self, exp: Experience) -> Experience:
        return exp.select(share(len(exp), self.layout.dp, self.layout.dp_rank))

    def _width_multiple(self) -> int:
        """Sequence parallelism splits every micro-batch's row over the TP ranks."""
        return self.layout.tp if self.settings.sequence_parallel else 1

    def _share_prefix(self, model) -> bool:
        from megareason.models.build import uses_transformer_engine

        return self.settings.share_prompt_prefix and not uses_transformer_engine(model)

    def _pack(self, mine: Experience, model, names=(), responses_only: bool = False) -> list:
        """This replica's share in micro-batches of ``trainer.micro_batch_tokens`` tokens. With experts spread
        over data-parallel ranks (EP > 1) every rank runs the largest rank's number of micro-batches: each
        micro-batch's MoE layers exchange tokens over the expert-parallel group (``packing.split_plan``)."""
        def pack(count: int = 0) -> list:
            return pack_experience(mine, self.settings.micro_batch_tokens, names,
                                   share_prefix=self._share_prefix(model), responses_only=responses_only,
                                   width_multiple=self._width_multiple(), count=count)

        micro = pack()
        if self.layout.ep > 1:
            count = _max_over_data_parallel(len(micro))
            if count > len(micro):
                micro = pack(count)
        return micro

    def stop_generating_on(self, path: str) -> None:
        """From now on the log-prob passes, and a training pass the driver marks stoppable (the step's first
        optimizer step), give up between pieces of their micro-batches (``UpdateStopped``) once the file
        ``path`` exists on any rank of the role (``schedule.agreed_stop``)."""
        self.stop_path = path

    def _stop_check(self):
        """The role's agreed stop check (None: no stop file given)."""
        from megareason.models.schedule import agreed_stop

        path = self.stop_path
        return agreed_stop(functools.partial(os.path.exists, path)) if path is not None else None

    def _outputs(self, model, head, num: int, exp: Experience, responses_only: bool = False) -> list[torch.Tensor]:
        """``head``'s outputs over this replica's share, as [B_share, T] rows (a pass that a stop may end)."""
        mine = self._share(exp)
        micro = self._pack(mine, model, responses_only=responses_only)
        with _update_stopped():
            outs = forward_outputs(model, micro, head, num, self._stop_check())
        # The whole batch's width, not the share's: the driver concatenates the replicas' rows.
        width = exp.tokens_BT.shape[1]
        return [unpack_to_rows([o[k] for o in outs], micro, mine.lengths_B, width) for k in range(num)]

    def _train(self, role, exp: Experience, names: list[str], loss_fn, lr: float, record: type[TrainStats],
               responses_only: bool = False, stoppable: bool = False) -> TrainStats:
        for group in role.optimizer.param_groups:
            group["lr"] = lr
        micro = self._pack(self._share(exp), role.model, names, responses_only=responses_only)
        with _update_stopped():
            result = role.train_step(micro, loss_fn, self._stop_check() if stoppable else None)
        return record.from_step(result.loss, result.grad_norm, result.metrics, result.moe)

    def save(self, path: str, metadata: dict, asynchronous: bool = False) -> None:
        self._write_checkpoint(path, metadata, asynchronous)

    def _write_checkpoint(self, path: str, metadata: dict, asynchronous: bool) -> None:
        self.role.save(path, metadata, asynchronous)

    def finish_saves(self, blocking: bool) -> bool:
        """Commit this rank's asynchronous checkpoint writes that every rank has finished (``blocking``: wait
        for all); True when none is left (``models/checkpoint.finish_saves``)."""
        from megareason.models.checkpoint import finish_saves

        return finish_saves(blocking)

    def load(self, path: str) -> dict:
        return self.role.load(path)

    def memory_by_phase(self) -> dict[str, float]:
        """This rank's GPU memory per phase since the last call (``models.memory.PhaseMemory.report``; empty on
        CPU)."""
        memory = self.__dict__.get("phase_memory")
        return memory.report() if memory is not None else {}

    def shutdown(self) -> None:
        from megareason.models.parallel import destroy_parallel

        destroy_parallel()


@contextlib.contextmanager
def _update_stopped():
    """A pass that a stop ended (``schedule.PassStopped``) leaves the worker as ``UpdateStopped``, which the
    driver's worker group passes on as a stop, not a failure (a ``GenerationStopped``)."""
    from megareason.models.schedule import PassStopped
    from megareason.rollout.records import UpdateStopped

    try:
        yield
    except PassStopped as e:
        raise UpdateStopped(str(e)) from None


def _max_over_data_parallel(n: int) -> int:
    """The largest ``n`` of the data-parallel ranks (on the accelerator under NCCL)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    return int(t.item())


class PolicyWorker(_Worker):
    """One rank of the policy: the actor, the reference (a frozen copy, or the LoRA actor with its adapters
    off) and this rank's share of the rollout engines (module docstring)."""

    remote = None  # rollout.placement: separate: the pool's engines, on the rank that pushes to them

    def _build(self) -> None:
        """The actor and the reference, then this GPU's share of the rollout engines. Every state here is planned
        (``launch/ledger.py``: start-up): the reference waits in host memory on GPU, and with
        ``trainer.offload_optimizer`` the actor's gradient buffers and fp32 main weights (built with the optimizer)
        leave the device before the engine starts, as before every later wake-up: vLLM takes its share of what
        is free then."""
        self.actor, self.reference = self._new_roles()
        self.role = self.actor
        if self.reference is not None and on_gpu():
            self.reference.offload()
        self._start_engine()

    def _new_roles(self):
        """(actor, reference or None): megatron-core models (tests substitute stand-ins here)."""
        from megareason.models.build import HFCheckpoint
        from megareason.models.hub import resolve_model_path
        from megareason.models.roles import Actor, Reference

        s: PolicySettings = self.settings
        # download=False: the driver fetched a Hub model into the cache before any worker started.
        ckpt = HFCheckpoint(resolve_model_path(s.model_path, download=False))
        # Log-probs at the sampling temperature: the policy that generated the rollouts.
        actor = Actor(ckpt, s.optimizer, s.compute, temperature=s.temperature, lora=s.lora)
        # With LoRA the reference is the actor with its adapters off: no second copy of the weights.
        return actor, Reference(ckpt, s.compute, temperature=s.temperature) if s.with_reference else None

    def _start_engine(self) -> None:
        from megareason.rollout.engine_state import EngineStateMachine
        from megareason.rollout.weight_sync import is_consumer

        s: PolicySettings = self.settings
        self.engine, self.engine_index, self.engine_leader = None, None, False
        if s.placement == "separate":  # the engines live in their own processes (trainer.pool)
            return
        if not s.colocated_engines and not is_consumer():  # the first rank of each replica holds a whole engine
            return
        if s.offload_optimizer:
            self.actor.offload_training_state()
        engine = self._new_engine()
        if s.colocated_engines:  # every rank holds one vLLM TP rank of engine rank // TP
            self.engine_index, self.engine_leader = engine.layout.engine, engine.layout.leader
        else:
            self.engine_index, self.engine_leader = self.layout.dp_rank, True
        # sleeps and wakes as the loop's phases need (rollout.engine_state)
        self.engine = EngineStateMachine(engine, empty_cache=self._before_wake)

    def _new_engine(self):
        """This rank's vLLM: an SPMD engine's TP rank (rollout TP > 1, colocated), else a whole engine."""
        from megareason.rollout import start_engine
        from megareason.rollout.colocated import ColocatedEngine

        s: PolicySettings = self.settings
        return ColocatedEngine(s.engine) if s.colocated_engines else start_engine(s.engine, self.rank)

    def _before_wake(self) -> None:
        """Before this GPU's engine wakes: with ``trainer.offload_optimizer`` the actor's gradient buffers and
        optimizer state leave for host memory (they come back at the next update or save); then the cached
        device memory goes back to the driver, where vLLM allocates."""
        if self.settings.offload_optimizer:
            self.actor.offload_training_state()
        self._empty_cache()

    def _empty_cache(self) -> None:
        from megareason.rollout.engine_state import empty_cuda_cache

        empty_cuda_cache()

    def attach_engines(self, remote) -> None:
        """rollout.placement: separate: the first rank that receives the weights (replica 0's consumer)
        pushes them into the pool's engines (``trainer.pool.RemoteEngines``); the other ranks only gather."""
        from megareason.rollout.weight_sync import is_consumer

        if self.layout.dp_rank == 0 and is_consumer():
            remote.check_node()
            self.remote = remote

    def rollout_engine(self) -> int | None:
        """The index of the engine whose outputs this rank returns (its first rank), else None."""
        return self.engine_index if self.engine_leader else None

    def generate(self, prompts_token_ids: list[list[list[int]]], samplings: list):
        """Each engine generates its own list of prompts (index ``rollout_engine`` of both lists); every
        rank of a colocated engine generates them all, and the engine's first rank returns them."""
        if self.engine is None:
            return None
        e = self.engine_index  # the state machine wakes what the engine needs (or refuses discarded weights)
        out = self.engine.generate(prompts_token_ids[e], samplings[e], use_tqdm=False)
        return out if self.engine_leader else None

    def save(self, path: str, metadata: dict, asynchronous: bool = False) -> None:
        """Write this rank's share of the checkpoint with the colocated engine asleep: megatron-core's
        distributed-optimizer save allocates receive buffers on the device for the parameters and both Adam
        moments (``optimizer/distrib_optimizer.py``, fully_reshardable), which an engine's KV cache would leave
        no room for. Every save takes this path (the schedule's, a signal's, a deadline's). Level 1: the
        engine's weights, current after the step's sync, wait in host memory; its next generate wakes it.
        ``asynchronous``: the save returns once the state is copied to host memory (the device buffers of the
        save are freed by then), and a background process writes it while the engine generates."""
        if self.engine is not None:
            self.engine.sleep(level=1)
        self._write_checkpoint(path, metadata, asynchronous)

    def load(self, path: str) -> dict:
        """Load the checkpoint with the engine asleep: the load brings the optimizer state back to the device and
        creates Adam's moments there (``models/checkpoint.py``), which an awake engine's KV cache leaves no room for.
        Level 2: the sync that follows (``Driver.start``) overwrites the weights, waking them through the same
        offload -> wake path as every step's sync (``EngineStateMachine.update_weights``). With
        ``trainer.offload_optimizer`` the loaded state leaves for host memory at once (PPO's critic loads next)."""
        if self.engine is not None:
            self.engine.sleep(level=2)
        metadata = self.role.load(path)
        if self.settings.offload_optimizer and self.engine is not None:
            self.actor.offload_training_state()
        return metadata

    def stop_generating_on(self, path: str) -> None:
        """This rank's engine gives up a generate (``GenerationStopped``) once the file ``path`` exists (the
        driver's stop file), and so do its passes (``_Worker.stop_generating_on``). The ranks of an SPMD engine
        spread over ranks (rollout TP > 1 colocated) agree on the engine step at which they give up
        (``ColocatedEngine``), so none waits alone in vLLM's collectives."""
        super().stop_generating_on(path)
        if self.engine is not None:
            self.engine.engine.should_stop = functools.partial(os.path.exists, path)

    def sleep_engine(self) -> None:
        """Before Megatron computes (the loop calls it): the engine frees the device. Level 2, weights
        discarded: every update ends with a weight sync, which overwrites them (level 1 would copy them
        to host memory and back for nothing). A sleeping engine stays as it is."""
        if self.engine is not None:
            self.engine.sleep(level=2)

    def logprobs(self, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """(old_logp, entropy) [B_share, T] under the actor's current weights."""
        logp, entropy = self._outputs(self.actor.model, self.actor.head, 2, exp, responses_only=True)
        return logp, entropy

    def ref_logprobs(self, exp: Experience) -> torch.Tensor:
        """[B_share, T] log-probs under the reference (on GPU it is onloaded for the pass, then offloaded)."""
        from megareason.models.lora import adapters_off

        ref = self.reference
        if ref is None:  # LoRA: the frozen base under the adapters
            with adapters_off(self.actor.model):
                (logp, _) = self._outputs(self.actor.model, self.actor.head, 2, exp, responses_only=True)
            return logp
        if on_gpu():
            ref.onload()
        try:
            (logp, _) = self._outputs(ref.model, ref.head, 2, exp, responses_only=True)
        finally:  # also when a stop ends the pass: the save that follows needs the room
            if on_gpu():
                ref.offload()
        return logp

    def train(self, exp: Experience, lr: float, on_policy: bool, stoppable: bool = False) -> PolicyStats:
        """One optimizer step of the policy loss over this replica's share of ``exp`` (a mini-batch).
        ``on_policy``: ``exp`` has no old log-probs; this forward pass gives them and measures the
        train/generation mismatch against ``rollout_logp_BT``. ``stoppable``: the pass gives up on a stop
        (``UpdateStopped``) before the optimizer step (the loop says so for the step's first one only)."""
        from megareason.trainer.losses import policy_loss_fn

        alg = self.settings.algorithm
        corrected = alg.rollout_tis_cap > 0 or alg.rollout_mis_cap > 0
        names = ["mask_BT", "adv_BT"] + (["rollout_logp_BT"] if on_policy or corrected else [])
        names += [] if on_policy else ["old_logp_BT"]
        names += ["ref_logp_BT"] if exp.ref_logp_BT is not None else []
        loss_fn = policy_loss_fn(alg, on_policy, self.settings.max_tokens)
        return self._train(self.actor, exp, names, loss_fn, lr, PolicyStats, responses_only=True, stoppable=stoppable)

    def sft_train(self, exp: Experience, lr: float) -> SftStats:
        """One supervised step: NLL of the response tokens (``megareason sft``)."""
        from megareason.trainer.losses import sft_loss_fn

        loss_fn = sft_loss_fn(self.settings.algorithm.loss_agg_mode, self.settings.max_tokens)
        return self._train(self.actor, exp, ["mask_BT"], loss_fn, lr, SftStats, responses_only=True)

    def sync_weights(self) -> WeightUpdate | None:
        """Stream the actor's weights into this replica's engine (every rank takes part). A failure on any
        rank raises ``WeightSyncError`` on every rank, naming it (``weight_sync.guarded_sync``)."""
        from megareason.rollout.weight_sync import SyncGuard, guarded_sync

        self._guard = SyncGuard()  # the streams of this sync (the separate engines' sender keeps _hf_weights)
        return guarded_sync(self._guard, self._sync)

    def _sync(self) -> WeightUpdate | None:
        if self.remote is not None:  # vLLM's weight-transfer API into the separate engines
            from megareason.models.weight_map import hf_shapes

            return self.remote.update_weights(self._hf_weights, hf_shapes(self.actor.arch),
                                              self.settings.weight_sync_bucket_mb << 20)
        stream = self._hf_weights()
        if self.engine is None:
            for _ in stream:  # this rank gathers and sends; the consumer loads
                pass
            return None
        # A sleeping engine's weights wake first, then its KV cache once they are loaded.
        update = self.engine.update_weights(stream, self.settings.weight_sync_bucket_mb << 20)
        return update if self.engine_leader else None

    def _hf_weights(self):
        from megareason.rollout.weight_sync import stream_hf_tensors

        guard = self._guard
        if self.settings.colocated_engines:  # every rank loads every tensor, in the engine's dtype, into its vLLM rank
            stream = stream_hf_tensors(self.actor.model, self.actor.arch, every_rank=True,
                                       dtype=self.engine.engine.dtype, guard=guard)
        else:
            stream = stream_hf_tensors(self.actor.model, self.actor.arch, guard=guard)
        guard.streams.append(stream)  # read to its end after a failed load (``guarded_sync``)
        return stream

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        super().shutdown()


# Each phase's real GPU memory into the worker's ``phase_memory`` (a no-op without a GPU), which
# ``memory_by_phase`` hands to the step's metrics: the plan's columns beside the truth (``models.memory``).
record_phases({PolicyWorker: {"generate": "generation", "logprobs": "logprobs", "ref_logprobs": "logprobs",
                              "train": "training", "sft_train": "training", "sync_weights": "sync", "save": "save",
                              "load": "resume"}})
