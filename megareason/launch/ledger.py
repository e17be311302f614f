"""The memory ledger: what one GPU rank (and its node's host memory) holds in every state of a run.

Every resident thing is a named **term** sized by the planner's formulas (``plan_memory``) for a config, a model
shape and a layout: the trainer's parameters, gradient buffers, fp32 main weights and Adam moments, the reference
model, PPO's critic, vLLM's weights, KV cache, activation peak and what it keeps while asleep (CUDA graphs, its
communicators), the weight sync's buffers, a checkpoint's save and load transients, and the memory a process holds
outside torch's caching allocator. A term is on the device, in host memory, or absent.

The run's **transitions** move terms, one method each, named for the call that does it on GPU:
``build_trainer`` / ``build_reference`` / ``start_engine`` (``trainer/workers.py`` ``PolicyWorker._build``),
``engine_sleep`` / ``engine_wake`` (``rollout/engine_state.py``), ``offload_training_state`` /
``onload_training_state`` (``models/offload.py`` as ``models/roles.py`` calls it), ``optimizer_step``,
``save`` and ``load`` (``models/checkpoint.py``), and the transients of a forward pass, a training step and a
weight sync. Each records the device total against the run's **state** (``enter``: start-up, resume,
generation, logprobs, training, sync, save), keeps each state's peak and the terms at it, and raises
``LedgerOverflow`` when the device total passes the cap.

Two users drive the same ledger: ``megareason plan`` replays one step of the loop (``plan_states``) and prints
each state's peak as a column; ``tests/test_memory_ledger.py`` drives the real training loops over stub workers
whose every Megatron and vLLM call is one of these transitions, and checks that each state it visits peaks
exactly where the plan says, under the cap.

Figures that are measured, not derived: memory outside torch's allocator (``OUTSIDE_ALLOCATOR_BYTES``), vLLM's
activation peak and what it keeps asleep (``VLLM_RESERVE_GIB``, ``VLLM_ASLEEP_GIB``), one NCCL communicator.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from megareason.config.schema import Config
from megareason.launch.plan_memory import (
    BYTES,
    checkpoint_save_bytes,
    layer_spec,
    recomputed_layers,
    stage_activations,
    stage_param_split,
    stage_params,
    states,
    total_params,
    working_set,
)
from megareason.launch.plan_records import GPU, GiB, element_bytes
from megareason.models.arch import ModelArch

# Inside vLLM's share: its profiled activation peak and what it keeps while asleep (CUDA graphs, its
# communicators' buffers): vLLM's sleep frees only its CuMemAllocator pool's KV cache and weights
# (vllm/device_allocator/cumem.py), the graphs' private pool stays.
VLLM_RESERVE_GIB = 2.0
VLLM_ASLEEP_GIB = 1.0
# Memory a trainer process holds outside torch's caching allocator (CUDA context, cuBLAS and cuDNN workspaces,
# NCCL's and the driver's own): total - free - torch.cuda.memory_reserved(), measured by tools/check_gpu.py
# (device_memory_totals) on an H200 at 3,410,821,120 and 9,576,448,000 bytes: the planner takes the larger.
OUTSIDE_ALLOCATOR_BYTES = 9_576_448_000
# One NCCL communicator's device buffers with NVLink SHARP off (every trainer worker sets NCCL_NVLS_ENABLE=0
# unless the site set it, as NeMo's launcher does: an NVLS communicator costs over 1 GiB, NVIDIA/nccl#864).
NCCL_COMMUNICATOR_GIB = 0.25
# What every state must leave free of cudaMemGetInfo's total (fragmentation: vLLM's sleep-mode allocator
# turns PyTorch's expandable_segments off inside its pool, vllm/device_allocator/cumem.py).
MARGIN_GIB = 5.0

DEVICE, HOST = "device", "host"
# The states of a run, in the order ``megareason plan`` prints them.
STATES = ("start-up", "resume", "generation", "sync", "logprobs", "training", "save")


class LedgerOverflow(RuntimeError):
    """A transition put more on the device than the cap; the message lists the terms on it."""


@dataclass
class Ledger:
    """One GPU rank's terms (``sizes``: name -> bytes), where each is now (``where``: name -> DEVICE or HOST;
    absent: not allocated), the current state and each state's peak. ``cap``: the device bytes no transition
    may pass (None: no check). Terms named ``*host_gather`` / ``*host_load`` (a checkpoint's gathers) live in
    host memory only. A state's peak is the largest device total recorded while it is the current state."""

    sizes: dict[str, int]
    cap: int | None = None
    where: dict[str, str] = field(default_factory=dict)
    state: str = "start-up"
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)  # state -> device terms at its peak
    host_peaks: dict[str, int] = field(default_factory=dict)  # state -> host bytes at its peak
    host_kept: set[str] = field(default_factory=set)  # pinned host blocks kept by the caching host allocator
    trail: list[tuple[str, str, int]] = field(default_factory=list)  # (state, transition, device bytes)
    _peak_totals: dict[str, int] = field(default_factory=dict, repr=False)

    # --- bookkeeping ----------------------------------------------------------------------------------

    def device(self) -> dict[str, int]:
        """The terms on the device now, with their bytes."""
        return {k: self.sizes[k] for k, w in self.where.items() if w == DEVICE and self.sizes.get(k, 0)}

    def device_total(self) -> int:
        sizes = self.sizes
        return sum(sizes[k] for k, w in self.where.items() if w == DEVICE)

    def host_total(self) -> int:
        """Host bytes of this rank: copies of device terms now in host memory, pinned blocks the caching host
        allocator keeps after they came back, and the host-only terms present."""
        on_host = {k for k, w in self.where.items() if w == HOST} | self.host_kept
        return sum(self.sizes.get(k, 0) for k in on_host)

    def enter(self, state: str) -> None:
        assert state in STATES, state
        self.state = state
        self._record("enter " + state)

    def _record(self, what: str) -> None:
        total = self.device_total()
        self.trail.append((self.state, what, total))
        if total > self._peak_totals.get(self.state, -1):
            self.peaks[self.state], self._peak_totals[self.state] = self.device(), total
        self.host_peaks[self.state] = max(self.host_peaks.get(self.state, 0), self.host_total())
        if self.cap is not None and total > self.cap:
            lines = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(self.device().items(), key=lambda kv: -kv[1]))
            raise LedgerOverflow(f"{self.state}: {what} puts {total / GiB:.1f} GiB on the GPU, more than "
                                 f"{self.cap / GiB:.1f} GiB (cudaMemGetInfo's total less {MARGIN_GIB:g} GiB): "
                                 f"{lines} (GiB)")

    def _move(self, what: str, names, to: str | None) -> None:
        for name in names:
            if name not in self.sizes:
                continue
            if to is None:
                self.where.pop(name, None)
            elif name.endswith(("host_gather", "host_load")):  # a host-only term
                self.where[name] = HOST
            else:
                if to == DEVICE and self.where.get(name) == HOST:
                    self.host_kept.add(name)  # the pinned copy stays cached (CachingHostAllocator)
                self.where[name] = to
        self._record(what)

    def put(self, what: str, *names: str) -> None:
        """Allocate (or bring back) ``names`` on the device."""
        self._move(what, names, DEVICE)

    def to_host(self, what: str, *names: str) -> None:
        """Copy ``names`` that are on the device to host memory and free them there."""
        self._move(what, [n for n in names if self.where.get(n) == DEVICE], HOST)

    def free(self, what: str, *names: str) -> None:
        self._move(what, names, None)

    @contextmanager
    def transient(self, what: str, *names: str):
        """``names`` exist for the block (a pass's working set, a save's buffers), then are freed."""
        self.put(what, *names)
        try:
            yield
        finally:
            self.free(what + " done", *names)

    # --- the run's transitions ------------------------------------------------------------------------

    def build_trainer(self, role: str = "") -> None:
        """A trained role built (``_Trainable``): parameters, DDP's gradient buffers, the optimizer's fp32 main
        weights (bf16), this process's memory outside the allocator and its communicators. Adam's moments
        come with the first step or a load."""
        self.put(f"build {role or 'actor'}", *(role + k for k in ("parameters", "gradients", "main_weights",
                                                                  "outside", "nccl")))

    def build_reference(self) -> None:
        """The reference built on the device, then offloaded to host memory (``PolicyWorker._build`` on GPU)."""
        self.put("build reference", "reference")
        self.to_host("offload reference", "reference")

    def offload_training_state(self, role: str = "", optimizer: bool = True) -> None:
        """``TrainingStateOffload.offload``: gradient buffers emptied (no copy: every update zeroes them), the
        main weights and Adam moments copied to pinned host memory (``optimizer``)."""
        self.free(f"offload {role or 'actor'} gradients", role + "gradients")
        if optimizer:
            self.to_host(f"offload {role or 'actor'} optimizer", role + "main_weights", role + "moments")

    def onload_training_state(self, role: str = "", gradients: bool = True) -> None:
        """``TrainingStateOffload.onload``: the optimizer state back (what was offloaded), the gradient buffers
        refilled (``gradients``)."""
        back = [role + k for k in ("main_weights", "moments") if self.where.get(role + k) == HOST]
        self.put(f"onload {role or 'actor'}", *back, *([role + "gradients"] if gradients else []))

    def optimizer_step(self, role: str = "") -> None:
        """A training step: its activations and backward working set while it runs; Adam's moments exist after
        the first one."""
        with self.transient(f"{role or 'actor'} micro-batches", "activations", "backward_working"):
            self.put(f"{role or 'actor'} Adam step", role + "moments")

    def forward(self, reference: bool = False) -> None:
        """A log-prob (or value) pass: a forward's working set; ``reference``: the reference onloaded for it."""
        if reference:
            self.put("onload reference", "reference")
        with self.transient("forward", "forward_working"):
            pass
        if reference:
            self.to_host("offload reference", "reference")

    def start_engine(self) -> None:
        """A colocated vLLM engine started: its whole share (weights, KV cache, activation peak, what it keeps
        asleep) and its NCCL communicator (created before vLLM's memory snapshot, outside the share)."""
        self.put("start vLLM", "vllm_weights", "kv_cache", "vllm_activations", "vllm_kept", "vllm_nccl")

    def engine_sleep(self, level: int) -> None:
        """vLLM's sleep: the KV cache and activation peak freed; level 1 copies the weights to pinned host
        memory, level 2 discards them. Its CUDA graphs and communicators stay."""
        self.free(f"vLLM sleep {level}", "kv_cache", "vllm_activations")
        if level == 1:
            self.to_host("vLLM weights to host", "vllm_weights")
        else:
            self.free("vLLM weights discarded", "vllm_weights")

    def engine_wake(self, tags: list[str] | None) -> None:
        tags = tags or ["weights", "kv_cache"]
        names = (["vllm_weights"] if "weights" in tags else []) + (["kv_cache", "vllm_activations"]
                                                                   if "kv_cache" in tags else [])
        self.put("vLLM wake " + ",".join(tags), *names)

    def weight_sync(self) -> None:
        """The gathered HF tensors in flight (the largest twice: the TP shards and their concatenation) and a
        bucket, while the engine's weights are being overwritten."""
        with self.transient("weight sync", "sync_gather"):
            pass

    def save(self, role: str = "") -> None:
        """A role's checkpoint: megatron-core's gather buffers on the device and the gathered state in host
        memory while it writes (``plan_memory.checkpoint_save_bytes``, ``host_save_bytes``)."""
        with self.transient(f"save {role or 'actor'}", role + "save_gather", role + "host_gather"):
            pass

    def load(self, role: str = "") -> None:
        """A role's checkpoint loaded: Adam's moments allocated on the device; megatron-core's ``fully_reshardable``
        load reads each gradient buffer's whole fp32 state into CPU tensors (``get_parameter_state_dp_zero`` with
        ``empty_data``: no device gather) and copies this rank's shards into the device tensors."""
        with self.transient(f"load {role or 'actor'}", role + "host_load"):
            self.put(f"load {role or 'actor'} optimizer", role + "moments")


# ------------------------------------------------------------------------------------------------ terms


@dataclass(frozen=True)
class Terms:
    """A rank's term sizes (``sizes``) and the line ``megareason plan`` prints for each (``labels``)."""

    sizes: dict[str, int]
    labels: dict[str, str]

    def lines(self, device: dict[str, int]) -> dict[str, float]:
        """Device terms as the plan's lines: label -> bytes, in the order of ``labels``."""
        return {self.labels[k]: device[k] for k in self.labels if k in device}


def megatron_communicators(tp: int, pp: int, dp: int, ep: int) -> int:
    """NCCL communicators a Megatron rank uses (NCCL builds one at a group's first collective): the world
    group (the weight sync's agreement), TP, DP (gradients, the distributed optimizer), PP (activations) and
    the embedding group joining the first and last stage, EP (the tokens' all-to-all) and the experts' DP."""
    return 1 + (tp > 1) + (dp > 1) + 2 * (pp > 1) + 2 * (ep > 1)


def micro_batches_in_flight(cfg: Config, rows_tokens: float, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds under 1F1B: min(PP - s, micro-batches per DP
    rank and mini-batch)."""
    p, t = cfg.parallel, cfg.trainer
    import math

    micro = max(1, math.ceil(rows_tokens / (p.data_parallel_size * cfg.algorithm.mini_batches)
                             / t.micro_batch_tokens))
    return min(p.pipeline_model_parallel_size - stage, micro)


def host_save_bytes(cfg: Config, arch: ModelArch, stage: int) -> int:
    """Host bytes one rank's ``fully_reshardable`` distributed-optimizer save gathers (megatron-core 0.16.1,
    ``optimizer/distrib_optimizer.py`` ``get_parameter_state_dp_zero`` with ``return_on_all_ranks``): for each
    gradient buffer of n parameters, fp32 ``param``, ``exp_avg`` and ``exp_avg_sq`` of the WHOLE buffer on the
    CPU (12·n, kept until written), its own shards copied out (12·n/DP), and per state the DP shards received
    and copied to the CPU (4·n) and concatenated (4·n): ~20 B per parameter of the rank's model-parallel
    shard, on every DP rank. A plain optimizer writes its tensors as they are (0)."""
    if not cfg.optim.use_distributed_optimizer:
        return 0
    p = cfg.parallel
    tp, pp, dp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                      p.expert_model_parallel_size)
    if cfg.lora.enabled:
        from megareason.launch.plan_memory import lora_params_per_gpu

        buffers = [(lora_params_per_gpu(arch, tp, pp, cfg.lora.rank, cfg.lora.targets), dp)]
    else:
        dense, expert = stage_param_split(arch, tp, pp, stage, ep)
        buffers = [(dense, dp)] + ([(expert, dp // ep)] if expert else [])
    whole = sum(12 * n + 12 * n // shards for n, shards in buffers)
    return whole + max(8 * n for n, _ in buffers)


def host_load_bytes(cfg: Config, arch: ModelArch, stage: int) -> int:
    """Host bytes one rank's ``fully_reshardable`` load reads: fp32 ``param``, ``exp_avg`` and ``exp_avg_sq`` of
    each whole gradient buffer (12 B per parameter of the rank's model-parallel shard), on every DP rank."""
    if not cfg.optim.use_distributed_optimizer:
        return 0
    p = cfg.parallel
    if cfg.lora.enabled:
        from megareason.launch.plan_memory import lora_params_per_gpu

        return 12 * lora_params_per_gpu(arch, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                        cfg.lora.rank, cfg.lora.targets)
    return 12 * sum(stage_param_split(arch, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, stage,
                                      p.expert_model_parallel_size))


def rank_terms(cfg: Config, arch: ModelArch, gpu: GPU, stage: int, rows_tokens: float) -> Terms:
    """Every term of a rank of pipeline stage ``stage`` (see the module docstring), sized by the planner's
    formulas; ``rows_tokens``: the tokens of a step's rows (``plan_records.workload``)."""
    p, r, t, alg = cfg.parallel, cfg.rollout, cfg.trainer, cfg.algorithm
    tp, pp, dp, ep, vtp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size,
                           p.expert_model_parallel_size, r.tensor_parallel_size)
    lora, act, spec = cfg.lora.enabled, BYTES[t.precision], layer_spec(cfg)
    separate = r.placement == "separate"
    st = states(cfg, arch, tp, pp, dp, stage, ep)
    main = st["optimizer_state"] // 3 if act == 2 else 0  # bf16: 4 of the 12 bytes per parameter
    shards = ""
    if cfg.optim.use_distributed_optimizer and dp > 1:
        shards = f" (/ DP {dp}, experts / DP/EP {dp // ep})" if arch.is_moe else f" (/ DP {dp})"
    trainer = {
        "parameters": (st["parameters"], f"parameters ({t.precision}{', base + LoRA adapters' if lora else ''})"),
        "gradients": (st["gradients"], f"gradients (fp32 main_grad{' of the LoRA adapters' if lora else ''})"),
        "main_weights": (main, f"optimizer: fp32 main weights{shards}"),
        "moments": (st["optimizer_state"] - main, f"optimizer: Adam moments{shards}"),
        "outside": (OUTSIDE_ALLOCATOR_BYTES, "outside torch's allocator: CUDA context, cuBLAS, NCCL (measured)"),
        "nccl": (int(megatron_communicators(tp, pp, dp, ep) * NCCL_COMMUNICATOR_GIB * GiB),
                 f"NCCL communicators: {megatron_communicators(tp, pp, dp, ep)} of Megatron's (NVLS off)"),
        "save_gather": (checkpoint_save_bytes(cfg, arch, tp, pp, dp, stage, ep),
                        "checkpoint save: distributed optimizer's gather buffers"),
        "host_gather": (0, ""),
    }
    items = dict(trainer)
    if alg.name == "ppo":  # the critic's own process: its copy of everything (value head ~ the output layer)
        items.update({"critic_" + k: (v, "critic: " + label) for k, (v, label) in trainer.items()})
    host = {"host_gather": host_save_bytes(cfg, arch, stage), "host_load": host_load_bytes(cfg, arch, stage)}
    if alg.name == "ppo":
        host.update({"critic_" + k: v for k, v in host.items()})
    if alg.kl_coef > 0 and not lora:  # LoRA: the reference is the actor with its adapters off
        items["reference"] = (act * stage_params(arch, tp, pp, stage, ep), "reference model (onloaded)")
    tok = t.micro_batch_tokens
    a = stage_activations(cfg, arch, tp, pp, tok, stage)
    flight = micro_batches_in_flight(cfg, rows_tokens, stage)
    recompute = {"none": "no recompute", "selective": "selective recompute"}.get(
        t.recompute, f"full recompute {recomputed_layers(cfg, arch, pp)}/{arch.num_layers // pp} layers")
    working = working_set(cfg, arch, tp, pp, tok, stage, spec)
    items["activations"] = (flight * a.saved + a.working, f"activations ({recompute}, {flight} in flight)")
    items["backward_working"] = (working, "backward working set")
    items["forward_working"] = (working, "forward working set")
    dbytes = element_bytes(r.dtype)
    largest = arch.padded_vocab_size(1) * arch.hidden_size * dbytes
    bucket = t.weight_sync_bucket_mb * 2**20
    items["sync_gather"] = (2 * largest + bucket, "weight sync: largest tensor gathered (x2: shards + whole) + bucket")
    if not separate:
        weights, kv = vllm_share(cfg, arch, gpu)
        items.update({
            "vllm_weights": (weights, "vLLM weights"),
            "kv_cache": (kv, "vLLM KV cache"),
            "vllm_activations": (int((VLLM_RESERVE_GIB - VLLM_ASLEEP_GIB) * GiB), "vLLM activation peak (profiled)"),
            "vllm_kept": (int(VLLM_ASLEEP_GIB * GiB), "vLLM CUDA graphs + buffers (kept while asleep)"),
            "vllm_nccl": (int(NCCL_COMMUNICATOR_GIB * GiB) if vtp > 1 else 0, "vLLM's NCCL communicator"),
        })
    sizes = {k: int(v) for k, (v, _) in items.items()}
    sizes.update(host)
    labels = {k: label for k, (v, label) in items.items() if label}
    return Terms(sizes, labels)


def vllm_share(cfg: Config, arch: ModelArch, gpu: GPU) -> tuple[int, int]:
    """(weights, KV cache) bytes of a vLLM engine's GPU: its share is gpu_memory_utilization x cudaMemGetInfo's
    total, less the weights over the rollout TP and the reserve (activation peak, graphs) for the KV cache."""
    r = cfg.rollout
    budget = r.gpu_memory_utilization * gpu.cuda_total_gib * GiB
    weights = total_params(arch) * element_bytes(r.dtype) / r.tensor_parallel_size
    return int(weights), int(budget - weights - VLLM_RESERVE_GIB * GiB)


def cap_bytes(gpu: GPU) -> int:
    """The device bytes no state may pass: cudaMemGetInfo's total less ``MARGIN_GIB``."""
    return int((gpu.cuda_total_gib - MARGIN_GIB) * GiB)


# ------------------------------------------------------------------------------------------------ the plan


def plan_states(cfg: Config, terms: Terms, resume: bool = True) -> Ledger:
    """One rank's ledger after the loop's sequence of transitions, as ``trainer/workers.py``,
    ``trainer/driver.py`` and ``trainer/loop.py`` run them on GPU: start-up (the roles built, the trainer's
    state offloaded with ``trainer.offload_optimizer``, the engine started), a resume (the engine asleep, the
    checkpoint loaded, the sync woken through the offload), then a step (generation, log-probs, training,
    sync), a checkpoint, and the next step's generation. ``peaks``: each state's peak, no cap."""
    alg, t = cfg.algorithm, cfg.trainer
    colocated = cfg.rollout.placement != "separate"
    led = Ledger(terms.sizes)
    critic = alg.name == "ppo"
    offload = t.offload_optimizer
    roles = [""] + (["critic_"] if critic else [])

    def before_wake() -> None:  # PolicyWorker._before_wake
        if offload:
            led.offload_training_state()

    def generate() -> None:
        led.enter("generation")
        if colocated and led.where.get("kv_cache") != DEVICE:  # EngineStateMachine.generate wakes a level-1 sleep
            before_wake()
            led.engine_wake(None)

    def sync(state: str) -> None:
        led.enter(state)
        asleep = colocated and led.where.get("kv_cache") != DEVICE
        if asleep:  # EngineStateMachine.update_weights: the weights first, the KV cache once they are loaded
            before_wake()
            led.engine_wake(["weights"])
        led.weight_sync()
        if asleep:
            led.engine_wake(["kv_cache"])

    # start-up: the critic's ranks (CriticWorker._build), then the policy's (PolicyWorker._build): handles.start_workers
    led.enter("start-up")
    if critic:
        led.build_trainer("critic_")
        if offload:
            led.offload_training_state("critic_")
    led.build_trainer()
    if "reference" in led.sizes:
        led.build_reference()
    if colocated:
        if offload:
            led.offload_training_state()
        led.start_engine()
    if resume:  # Driver.start: every role loads with the engine asleep (PolicyWorker.load), then the sync
        led.enter("resume")
        if colocated:
            led.engine_sleep(2)
        for role in roles:
            led.onload_training_state(role, gradients=False)
            led.load(role)
            if offload and (role or colocated):  # PolicyWorker.load, CriticWorker.load
                led.offload_training_state(role)
        sync("resume")
    # a step (trainer/loop.py): generation, the engine asleep for log-probs and training, then the sync
    on_policy = alg.ppo_epochs == 1 and alg.mini_batches == 1 and not (alg.kl_in_reward and alg.kl_coef > 0)
    for _ in range(2):
        generate()
        if colocated:
            led.engine_sleep(2)  # PolicyHandle.sleep_engine before Megatron computes
        if not on_policy or alg.kl_coef > 0 or critic:
            led.enter("logprobs")
            if not on_policy:
                led.forward()
            if alg.kl_coef > 0:
                led.forward(reference="reference" in led.sizes)
            if critic:
                led.forward()
        led.enter("training")
        for role in roles:
            led.onload_training_state(role)
            led.optimizer_step(role)
            if role and offload:  # CriticWorker.train: no engine in its process, off after each update
                led.offload_training_state(role)
        sync("sync")
        # a checkpoint (PolicyWorker.save): the engine asleep at level 1, then each role's optimizer state on,
        # its gradients off (models/roles.py), the write
        if colocated:
            led.engine_sleep(1)
        led.enter("save")
        for role in roles:
            led.onload_training_state(role, gradients=False)
            led.offload_training_state(role, optimizer=False)
            led.save(role)
            if role and offload:  # CriticWorker.save
                led.offload_training_state(role)
    generate()
    return led
