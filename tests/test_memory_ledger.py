"""Every state a run passes through fits the GPU: the memory ledger (``launch/ledger.py``) charged by the real loops.

The training loops (``trainer.loop._train_loop``, ``trainer.sft._loop``) and the driver run for real over
in-process ``PolicyWorker`` / ``CriticWorker`` ranks whose own code runs too (``_build``, ``load``, ``save``,
``sync_weights``, ``sleep_engine``, ``ref_logprobs``, and the roles' ``models/roles.py`` onload/offload order);
only what would run Megatron or vLLM is a stand-in that charges the ledger instead: the models' construction,
a forward pass, a training step, a checkpoint's write and read, vLLM's sleep, wake-up and weight load
(``FakeVLLM``'s semantics, so a generate on a sleeping engine still fails). The terms are sized for the GPU
recipes at their layouts (70B RARO, Qwen3-8B, Qwen3-30B-A3B on H100-80GB), one ledger per pipeline stage,
each with the cap cudaMemGetInfo's total - 5 GiB: a transition past it raises ``LedgerOverflow`` in the loop.
Each state the runs visit must peak exactly where ``megareason plan`` prints it. In process, no Ray, seconds.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_engine_state import FakePool, FakeVLLM, InProcessGroup, _prompts, _reply, _score

from megareason.config import load_config
from megareason.launch.ledger import STATES, Ledger, LedgerOverflow, cap_bytes, rank_terms
from megareason.launch.plan import make_plan
from megareason.launch.plan_records import GPUS, MODEL_SHAPES, GiB, PlanOptions, workload
from megareason.models.roles import Actor, Critic
from megareason.models.tiny import build_tokenizer
from megareason.models.train import StepResult
from megareason.rollout.records import WeightUpdate
from megareason.trainer.critic_worker import CriticWorker
from megareason.trainer.driver import EXIT_STOPPED, stop_signals
from megareason.trainer.handles import critic_settings, policy_settings
from megareason.trainer.run_dir import RunDir
from megareason.trainer.stats import CriticStats, PolicyStats, SftStats
from megareason.trainer.workers import PolicyWorker

GPU = GPUS["H100-80GB"]
# recipe -> (model shape, nodes of 8 GPUs)
RECIPES = {"raro_70b": ("llama-3.1-70b", 8), "grpo_qwen3_8b": ("qwen3-8b", 1),
           "grpo_qwen3_30b_a3b": ("qwen3-30b-a3b", 4)}
# What makes a recipe run in seconds on the tiny tokenizer; none of it changes a term (the terms are sized by
# the recipe's own config, ``Recipe.cfg``).
LOOP = ["model.path=smollm2-135m-instruct", "trainer.prompts_per_step=2", "rollout.n=2", "trainer.loggers=[]",
        "trainer.save_every=1", "raro.critic_n=2", "raro.replay_buffer_ratio=0.0", "raro.constrain_verdict_chars=0"]


class Ledgers:
    """One ledger per pipeline stage of the rank kind the stubs stand for; every call goes to each of them."""

    def __init__(self, cfg, arch, opt: PlanOptions):
        rows = sum(p.tokens for p in workload(cfg, opt))
        self.terms = [rank_terms(cfg, arch, GPU, s, rows) for s in range(cfg.parallel.pipeline_model_parallel_size)]
        self.ledgers = [Ledger(t.sizes, cap=cap_bytes(GPU)) for t in self.terms]

    def __getattr__(self, name):
        return lambda *a, **k: [getattr(led, name)(*a, **k) for led in self.ledgers]

    def peaks(self) -> dict[str, dict[str, float]]:
        """Each visited state's peak as the plan prints it: the lines of its most loaded stage."""
        out = {}
        for state in STATES:
            seen = [(s, led.peaks[state]) for s, led in enumerate(self.ledgers) if state in led.peaks]
            if seen:
                s, peak = max(seen, key=lambda sp: sum(sp[1].values()))
                out[state] = self.terms[s].lines(peak)
        return out

    def host_peaks(self) -> dict[str, int]:
        return {st: max(led.host_peaks.get(st, 0) for led in self.ledgers) for st in STATES
                if any(st in led.host_peaks for led in self.ledgers)}


class LedgerVLLM(FakeVLLM):
    """vLLM's semantics (``FakeVLLM``), its memory charged: sleep, wake-up, the weight load's buffers."""

    def __init__(self, tok, ledgers: Ledgers):
        super().__init__(tok, _reply)
        self.ledgers, self.dtype = ledgers, torch.bfloat16
        self.layout = SimpleNamespace(engine=0, leader=True)
        ledgers.start_engine()

    def sleep(self, level: int) -> None:
        super().sleep(level)
        self.ledgers.engine_sleep(level)

    def wake_up(self, tags=None) -> None:
        super().wake_up(tags)
        self.ledgers.engine_wake(tags)

    def update_weights(self, named_tensors, bucket_bytes: int) -> WeightUpdate:
        self.ledgers.weight_sync()
        return super().update_weights(named_tensors, bucket_bytes)


class LedgerOffload:
    """``models.offload.TrainingStateOffload`` of one role, charged."""

    def __init__(self, ledgers: Ledgers, role: str):
        self.ledgers, self.role = ledgers, role

    def offload(self, optimizer: bool = True) -> None:
        self.ledgers.offload_training_state(self.role, optimizer)

    def onload(self, gradients: bool = True) -> None:
        self.ledgers.onload_training_state(self.role, gradients)


def _role(cls, ledgers: Ledgers, role: str):
    """A real ``Actor`` / ``Critic`` (its train_step / save / load / offload code) over charged stand-ins."""
    ledgers.build_trainer(role)
    r = object.__new__(cls)
    r.model, r.arch, r.hf_dir, r.lora = SimpleNamespace(config=SimpleNamespace(bf16=True)), None, "/m", None
    r.ddp, r.router_watch, r.head = None, None, None
    r.optimizer = SimpleNamespace(param_groups=[{}], ledgers=ledgers, role=role)
    r.training_state = LedgerOffload(ledgers, role)
    return r


class LedgerReference:
    def __init__(self, ledgers: Ledgers):
        self.ledgers, self.model, self.head = ledgers, None, None
        ledgers.put("build reference", "reference")

    def offload(self) -> None:
        self.ledgers.to_host("offload reference", "reference")

    def onload(self) -> None:
        self.ledgers.put("onload reference", "reference")


@pytest.fixture(autouse=True)
def charged(monkeypatch):
    _charge(monkeypatch)


def _charge(monkeypatch) -> None:
    """Megatron's train step and checkpoint write / read, as ``models/roles.py`` calls them, charged; the
    workers take their GPU path (the reference offloaded between uses)."""
    import megareason.models.roles as roles
    import megareason.trainer.workers as workers

    def train_step(ddp, optimizer, micro_batches, head, loss_fn, router_watch, stop=None):
        optimizer.ledgers.optimizer_step(optimizer.role)
        return StepResult(loss=0.1, grad_norm=1.0, metrics={})

    def save_checkpoint(path, model, arch, hf_dir, optimizer, metadata, asynchronous=False):
        optimizer.ledgers.save(optimizer.role)

    def load_checkpoint(path, model, optimizer):
        optimizer.ledgers.load(optimizer.role)
        return {}

    monkeypatch.setattr(roles, "train_step", train_step)
    monkeypatch.setattr(roles, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(roles, "load_checkpoint", load_checkpoint)
    monkeypatch.setattr(workers, "on_gpu", lambda: True)


def _stats(record, **extra):
    sums = {PolicyStats: dict(pg_loss_num=0.0, pg_loss_den=1, clipfrac_sum=0.0, ppo_kl_sum=0.0, entropy_sum=1.0),
            SftStats: dict(nll_num=1.0, nll_den=1),
            CriticStats: dict(vf_loss_num=0.0, vf_loss_den=1, vf_clipfrac_sum=0.0, vpred_sum=0.0)}[record]
    return record(loss=0.1, grad_norm=1.0, tokens=10, **sums, **extra)


class _Charged:
    """What both stub roles share: the layout of one rank, and the state each worker call enters."""

    hooks: dict = {}  # state -> [n, callable]: run when a worker call enters it the n-th time (the stop tests)

    def _setup(self, ledgers: Ledgers):
        self.ledgers = ledgers
        self.layout = SimpleNamespace(dp=1, dp_rank=0, tp=1, tp_rank=0, pp=1, pp_rank=0, ep=1)
        self._build()

    def _enter(self, state: str) -> None:
        self.ledgers.enter(state)
        hook = self.hooks.get(state)
        if hook is not None:
            hook[0] -= 1
            if hook[0] == 0:
                hook[1]()

    def _outputs(self, model, head, num, exp, responses_only=False):
        self._enter("logprobs")
        self.ledgers.forward()
        rows = torch.zeros(len(self._share(exp)), exp.tokens_BT.shape[1])
        return [rows] * num

    def _train(self, role, exp, names, loss_fn, lr, record, responses_only=False, stoppable=False):
        """The worker's train / sft_train / critic train run for real up to here: the role's step, charged."""
        self._enter("training")
        role.train_step([], loss_fn)
        on_policy = record is PolicyStats and "old_logp_BT" not in names  # the update's own forward: the mismatch
        return _stats(record, **({"mismatch_sum": 10.0, "logp_diff_max": 0.0} if on_policy else {}))

    def _write_checkpoint(self, path, metadata, asynchronous):
        self._enter("save")
        super()._write_checkpoint(path, metadata, asynchronous)

    def load(self, path):
        self._enter("resume")
        return super().load(path)

    def shutdown(self):
        pass


class LedgerPolicy(_Charged, PolicyWorker):
    def __init__(self, cfg, ledgers: Ledgers, tok):
        PolicyWorker.__init__(self, policy_settings(cfg), 0, 1)
        self.tok = tok
        self._setup(ledgers)

    def _new_roles(self):
        return _role(Actor, self.ledgers, ""), LedgerReference(self.ledgers) if self.settings.with_reference else None

    def _new_engine(self):
        self.vllm = LedgerVLLM(self.tok, self.ledgers)
        return self.vllm

    def _empty_cache(self):
        self.vllm.empty_cache()

    def _hf_weights(self):
        if self.engine is None:  # separate engines: this rank gathers and sends (a colocated one loads: LedgerVLLM)
            self.ledgers.weight_sync()
        yield "model.embed_tokens.weight", torch.ones(4, 2)

    def attach_engines(self, remote):
        pass

    def generate(self, prompts_token_ids, samplings):
        self._enter("generation")
        return super().generate(prompts_token_ids, samplings)

    def sync_weights(self):
        self._enter("resume" if self.ledgers.ledgers[0].state == "resume" else "sync")
        return super().sync_weights()



class LedgerCritic(_Charged, CriticWorker):
    def __init__(self, cfg, ledgers: Ledgers):
        CriticWorker.__init__(self, critic_settings(cfg), 0, 1)
        self._setup(ledgers)

    def _new_critic(self):
        return _role(Critic, self.ledgers, "critic_")



@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class Recipe:
    """A GPU recipe (``configs/<name>.yaml`` with ``overrides``) at its layout: its plan, and the loop's config."""

    def __init__(self, name: str, overrides=(), nodes: int = 0):
        shape, nodes = RECIPES[name][0], nodes or RECIPES[name][1]
        self.name, self.arch = name, MODEL_SHAPES[shape]
        self.opt = PlanOptions(nodes=nodes, gpus_per_node=8)
        self.cfg = load_config(name, list(overrides))
        self.overrides = list(overrides)

    def plan(self):
        return make_plan(self.cfg, self.arch, self.opt, config_name=self.name)

    def loop_cfg(self, *more: str):
        """The loop's config: the recipe's, cut to seconds of work on one in-process rank (``LOOP``)."""
        cfg = load_config(self.name, [*LOOP, *self.overrides, *more])
        return replace(cfg, parallel=replace(cfg.parallel, data_parallel_size=1))

    def run(self, tmp_path, tok, *more: str, stop=None, started=None, prompts=None) -> Ledgers:
        from megareason.trainer.loop import _train_loop

        cfg = self.loop_cfg(*more)
        ledgers = Ledgers(self.cfg, self.arch, self.opt)
        if started is not None:
            started.append(ledgers)
        # handles.start_workers's order: the critic's ranks first, then the policy's with their engines
        critic = [InProcessGroup("critic", [LedgerCritic(cfg, ledgers)])] if cfg.algorithm.name == "ppo" else []
        groups = [InProcessGroup("actor", [LedgerPolicy(cfg, ledgers, tok)])] + critic
        prompts, val = prompts or (_prompts(tok, 5), _prompts(tok, 2))
        pool = FakePool(tok, []) if cfg.rollout.placement == "separate" else None
        _train_loop(cfg, RunDir(str(tmp_path)), groups, prompts, val, _score, tok, stop=stop, engines=pool)
        return ledgers

    def sft(self, tmp_path, tok, *more: str) -> Ledgers:
        """``megareason sft``'s loop (``trainer.sft._loop``) over the same charged policy rank."""
        from megareason.rollout.records import Completion
        from megareason.trainer.sft import _loop

        cfg = self.loop_cfg(*more)
        ledgers = Ledgers(self.cfg, self.arch, self.opt)
        prompts = _prompts(tok, 4)
        answers = [Completion(token_ids=tok.encode("2", add_special_tokens=False), text="2", logprobs_T=[0.0],
                              finish_reason="stop") for _ in prompts]
        _loop(cfg, RunDir(str(tmp_path)), InProcessGroup("actor", [LedgerPolicy(cfg, ledgers, tok)]),
              (prompts, answers), (prompts[:2], answers[:2]), _score)
        return ledgers


def _merge(*runs: Ledgers) -> dict[str, dict[str, float]]:
    """Each state's peak over ``runs`` (as the plan's lines)."""
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        for state, lines in run.peaks().items():
            if state not in out or sum(lines.values()) > sum(out[state].values()):
                out[state] = lines
    return out


def _gib(lines: dict[str, float]) -> str:
    return f"{sum(lines.values()) / GiB:.2f} GiB"


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_fits_every_state_of_a_fresh_start_and_a_resume_and_the_plan_prints_their_peaks(name, tok,
                                                                                                   tmp_path):
    """Two steps with a checkpoint after each, then a third from step 2's checkpoint (the requeue): no
    transition passes cudaMemGetInfo's total - 5 GiB, and every state's peak, start-up and resume included,
    is the plan's column to the byte (its lines and their bytes), with the plan's >= 5 GiB free."""
    recipe = Recipe(name)
    fresh = recipe.run(tmp_path, tok, "trainer.steps=2")
    resumed = recipe.run(tmp_path, tok, "trainer.steps=3")
    assert "resume" in resumed.peaks() and "resume" not in fresh.peaks()
    plan = recipe.plan()
    seen = _merge(fresh, resumed)
    assert set(seen) == set(plan.memory)  # one column per state the runs visit, no other
    for state, lines in seen.items():
        assert lines == plan.memory[state], (state, _gib(lines), _gib(plan.memory[state]))
        assert sum(lines.values()) <= cap_bytes(GPU)
    # host memory: the plan's per-node figure is the rank's peak x the node's ranks, within the node's RAM
    host = {st: max(run.host_peaks().get(st, 0) for run in (fresh, resumed)) for st in seen}
    assert {st: 8 * v for st, v in host.items()} == plan.host_per_node
    assert max(plan.host_per_node.values()) <= recipe.opt.node_memory_gib * GiB


def _stopped(recipe: Recipe, tmp_path, tok, state: str, *more: str, nth: int = 1) -> Ledgers:
    """A run that gets a SIGTERM (a real signal to this process) when a worker call enters ``state`` the
    ``nth`` time; it must exit with EXIT_STOPPED; its ledgers (a transition past the cap has raised already)."""
    sent, started = [], []
    _Charged.hooks = {state: [nth, lambda: sent.append(os.kill(os.getpid(), signal.SIGTERM))]}
    try:
        with stop_signals() as stop, pytest.raises(SystemExit) as stopped:
            recipe.run(tmp_path, tok, *more, stop=stop, started=started)
    finally:
        _Charged.hooks = {}
    assert sent and stopped.value.code == EXIT_STOPPED
    return started[0]


@pytest.fixture(scope="module")
def step_one(tok, tmp_path_factory):
    """The 70B RARO recipe's run folder after step 1 (its checkpoint), and the run's ledgers."""
    folder = tmp_path_factory.mktemp("raro_70b_step1")
    with pytest.MonkeyPatch.context() as mp:
        _charge(mp)
        return folder, Recipe("raro_70b").run(folder, tok, "trainer.steps=1")


@pytest.mark.parametrize("state", ["generation", "logprobs", "training", "sync", "save"])
def test_a_sigterm_in_each_state_of_the_70b_recipe_saves_and_resumes_within_the_plan(state, tok, tmp_path, step_one):
    """The 70B RARO recipe stopped in each state of step 2 (its checkpoint, or the one before, written with the
    engine asleep), then resumed to the end: every state within the plan's column, none past the cap."""
    import shutil

    recipe = Recipe("raro_70b")
    shutil.copytree(step_one[0], tmp_path, dirs_exist_ok=True)
    runs = [step_one[1]]
    runs.append(_stopped(recipe, tmp_path, tok, state, "trainer.steps=4"))
    runs.append(recipe.run(tmp_path, tok, "trainer.steps=4"))
    assert RunDir(str(tmp_path)).steps()[-1] == 4
    plan = recipe.plan()
    for run in runs:
        for st, lines in run.peaks().items():
            assert sum(lines.values()) <= sum(plan.memory[st].values()), (st, _gib(lines))


def test_the_deadline_save_and_a_stopped_validation_fit(tok, tmp_path):
    """trainer.must_save_by_minutes passed at once: the checkpoint after step 1, the exit; a SIGTERM during
    validation (Qwen3-8B with a validation set): the step saved with its metrics pending. Both within the plan."""
    recipe = Recipe("grpo_qwen3_8b")
    plan = recipe.plan()
    with pytest.raises(SystemExit) as stopped:
        run = recipe.run(tmp_path / "deadline", tok, "trainer.steps=3", "trainer.must_save_by_minutes=1e-9")
    assert stopped.value.code == EXIT_STOPPED and RunDir(str(tmp_path / "deadline")).steps() == [1]
    # generation entries: step 1's rollout, then its validation
    validation = _stopped(recipe, tmp_path / "val", tok, "generation", "trainer.steps=2", "trainer.val_every=1",
                          nth=2)
    for run in (validation,):
        for st, lines in run.peaks().items():
            assert sum(lines.values()) <= sum(plan.memory[st].values()), st


@pytest.mark.parametrize("name,overrides", [
    # PPO at 70B: two processes a GPU (each ~9 GiB outside the allocator) fit at PP 8 x DP 1, not at PP 4 x DP 2
    ("raro_70b", ["algorithm.name=ppo", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2",
                  "rollout.gpu_memory_utilization=0.45", "parallel.pipeline_model_parallel_size=8",
                  "parallel.data_parallel_size=1", "trainer.recompute_num_layers=0"]),
    ("grpo_qwen3_8b", ["algorithm.kl_coef=0.01"]),
    ("grpo_qwen3_30b_a3b", ["trainer.offload_optimizer=false", "rollout.gpu_memory_utilization=0.4"]),
])
def test_other_algorithms_on_the_recipes_layouts_peak_where_their_plans_say(name, overrides, tok, tmp_path):
    """PPO with a critic beside the actor (each process its own state, epochs and mini-batches), GRPO with a
    reference model, and the trainer's state left on the GPU: a fresh start and a resume, equal to their plans."""
    recipe = Recipe(name, overrides)
    fresh = recipe.run(tmp_path, tok, "trainer.steps=2")
    resumed = recipe.run(tmp_path, tok, "trainer.steps=3")
    plan = recipe.plan()
    seen = _merge(fresh, resumed)
    assert set(seen) == set(plan.memory)
    for state, lines in seen.items():
        assert lines == plan.memory[state], (state, _gib(lines), _gib(plan.memory[state]))


class LedgerCuda:
    """``torch.cuda`` as ``models.memory.PhaseMemory`` reads it, answered from a stage-0 ledger: used bytes
    = the device total now, the allocator's peak = the largest device total since the last reset."""

    def __init__(self, ledger: Ledger):
        self.ledger, self.since = ledger, 0

    def is_available(self) -> bool:
        return True

    def reset_peak_memory_stats(self) -> None:
        self.since = len(self.ledger.trail)

    def max_memory_allocated(self) -> int:
        return max([self.ledger.device_total()] + [b for _, _, b in self.ledger.trail[self.since:]])

    def mem_get_info(self) -> tuple[int, int]:
        total = int(GPU.cuda_total_gib * GiB)
        return total - self.ledger.device_total(), total


def test_each_phase_s_real_memory_goes_into_the_metrics_beside_the_plan(tok, tmp_path, monkeypatch):
    """On GPU every worker call records its phase's memory (``PhaseMemory``: cudaMemGetInfo's used bytes at its
    end, the allocator's peak during it) and the loop logs them per step (``<role>/memory/<phase>/...``). Here a
    stand-in device answers from the ledger: the logged training peak is the plan's training column of stage 0,
    the generation's used bytes the engine awake beside the trainer. Without a device nothing is logged."""
    import json

    import megareason.models.memory as memory

    recipe = Recipe("grpo_qwen3_8b")
    made: list[Ledgers] = []
    init = memory.PhaseMemory.__init__
    monkeypatch.setattr(memory.PhaseMemory, "__init__", lambda self, cuda=None: init(self, LedgerCuda(
        made[-1].ledgers[0])))
    run = recipe.run(tmp_path, tok, "trainer.steps=2", started=made)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    plan = recipe.plan()
    for row in rows:
        assert row["actor/memory/training/allocator_peak_gib"] == pytest.approx(
            sum(plan.memory["training"].values()) / GiB)
        assert row["actor/memory/generation/used_gib"] == pytest.approx(sum(plan.memory["generation"].values()) / GiB)
    # a step's row is logged before its checkpoint: the save's memory comes with the next step's row
    assert [sorted({k.split("/")[2] for k in row if k.startswith("actor/memory/")}) for row in rows] == [
        ["generation", "sync", "training"], ["generation", "save", "sync", "training"]]
    assert rows[1]["actor/memory/save/used_gib"] <= sum(plan.memory["save"].values()) / GiB
    assert run.ledgers[0].peaks["save"]
    monkeypatch.setattr(memory.PhaseMemory, "__init__", init)
    recipe.run(tmp_path / "cpu", tok, "trainer.steps=1")
    assert not any(k.startswith("actor/memory") for k in json.loads((tmp_path / "cpu" / "metrics.jsonl").read_text()))


# --- tools/check_gpu.py's memory checks: the logic that runs without a GPU ------------------------------


def _gpu_memory():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_memory

    return gpu_memory


class FakeDriver:
    """libcuda's virtual-memory entry points as ``tools/gpu_memory.VMM`` calls them: 2 MiB granularity, ``free``
    bytes of device memory; records each call."""

    def __init__(self, free: int):
        self.free, self.calls, self.mapped = free, [], {}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            return getattr(self, "_" + name, lambda *a: 0)(*args)
        return call

    def _cuMemGetAllocationGranularity(self, out, prop, option):
        out._obj.value = 2 << 20
        assert prop._obj.type == 1 and prop._obj.location.type == 1 and option == 0  # pinned, on the device
        return 0

    def _cuMemCreate(self, handle, size, prop, flags):
        if size.value > self.free:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        self.free -= size.value
        handle._obj.value = len(self.calls)
        self.mapped[handle._obj.value] = size.value
        return 0

    def _cuMemRelease(self, handle):
        self.free += self.mapped.pop(handle.value if hasattr(handle, "value") else handle)
        return 0


def test_the_vmm_check_maps_the_freed_bytes_as_vllm_s_wake_up_and_fails_when_they_are_not_free():
    gm = _gpu_memory()
    driver = FakeDriver(free=64 << 20)
    vmm = gm.VMM(0, lib=driver)
    m = vmm.allocate(5 << 20)  # rounded up to the 2 MiB granularity
    assert m.size == 6 << 20 and driver.free == 58 << 20
    # vLLM's create_and_map order (csrc/cumem_allocator.cpp), then unmap_and_release
    assert driver.calls[1:] == ["cuMemGetAllocationGranularity", "cuMemCreate", "cuMemAddressReserve", "cuMemMap",
                                "cuMemSetAccess"]
    vmm.free(m)
    assert driver.calls[-3:] == ["cuMemUnmap", "cuMemRelease", "cuMemAddressFree"] and driver.free == 64 << 20
    with pytest.raises(gm.CudaError, match="cuMemCreate returned CUresult 2 \\(out of memory\\)") as e:
        vmm.allocate(65 << 20)
    assert e.value.code == 2


def test_twin_steps_sees_an_offload_that_keeps_the_state_and_one_that_loses_it():
    """Two torch twins (Adam, a DDP-like gradient buffer): through the loop's moves ``TrainingStateOffload`` keeps
    the twin bit-exact for 3 steps; an offload that loses Adam's moments on the way shows at the next step."""
    from megareason.models.offload import TrainingStateOffload

    gm = _gpu_memory()

    def twin():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        grads = torch.zeros(sum(p.numel() for p in model.parameters()))
        inner = torch.optim.Adam(model.parameters(), lr=0.1)
        ddp = SimpleNamespace(parameters=model.parameters, buffers=[SimpleNamespace(grad_data=grads)],
                              expert_parallel_buffers=[])
        t = SimpleNamespace(model=model, grads=grads, inner=inner, parameters=model.parameters)
        t.training_state = TrainingStateOffload(ddp, SimpleNamespace(optimizer=inner))
        return t

    def step(t):  # megatron-core's order: gradients into the buffer, the optimizer steps from its views
        t.grads.zero_()
        t.model.zero_grad()
        t.model(torch.arange(16.0).reshape(2, 8)).square().sum().backward()
        torch.cat([p.grad.flatten() for p in t.model.parameters()], out=t.grads)
        offset = 0
        for p in t.model.parameters():
            p.grad = t.grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        t.inner.step()

    saved = []
    assert gm.twin_steps(twin(), twin(), step, lambda t: saved.append(t.inner.state_dict())) == [True] * 3
    assert len(saved) == 3

    lossy = twin()
    real_onload = lossy.training_state.onload

    def onload(gradients=True):
        real_onload(gradients)
        for state in lossy.inner.state.values():
            state["exp_avg"].zero_()

    lossy.training_state.onload = onload
    assert gm.twin_steps(twin(), lossy, step, lambda t: None) == [True, False, False]


def test_one_step_off_environments_and_sft_on_the_8b_layout_peak_within_their_plans(tok, tmp_path):
    """Qwen3-8B's layout with separate engines one step off (the trainer's GPUs hold no vLLM: every state of its
    rank equal to the plan's, the generation column being the engines' GPUs), a multi-turn environment's episodes
    (several generates a step) and SFT's loop (its validation syncs, then generates): each within its plan."""
    from megareason.data.loaders import load_records
    from megareason.data.prompts import tokenize_prompts

    separate = Recipe("grpo_qwen3_8b", ["rollout.placement=separate", "trainer.max_staleness=1",
                                        "rollout.num_engines=8", "rollout.tensor_parallel_size=1"], nodes=2)
    fresh = separate.run(tmp_path / "async", tok, "trainer.steps=2")
    resumed = separate.run(tmp_path / "async", tok, "trainer.steps=3")
    plan = separate.plan()
    seen = _merge(fresh, resumed)
    assert set(seen) == set(plan.memory) - {"generation"}
    for state, lines in seen.items():
        assert lines == plan.memory[state], (state, _gib(lines), _gib(plan.memory[state]))

    recipe = Recipe("grpo_qwen3_8b")
    plan = recipe.plan()
    env = load_config("grpo_multihop_cpu", ["env.initial_search=false", "env.max_turns=3"])
    records = load_records(replace(env.data, sources=[replace(env.data.sources[0], size=6)]))
    episodes = tokenize_prompts(records, tok, 4096, "error")
    runs = [recipe.run(tmp_path / "env", tok, "trainer.steps=2", "env.name=retrieval_qa", "env.retriever=bm25",
                       "env.initial_search=false", "env.max_turns=3", prompts=(episodes[:4], episodes[4:])),
            recipe.sft(tmp_path / "sft", tok, "trainer.steps=2")]
    assert all("generation" in run.peaks() and "training" in run.peaks() for run in runs)
    for run in runs:  # SFT's validation loss is a forward pass: within training's column, which holds more
        for state, lines in run.peaks().items():
            assert sum(lines.values()) <= sum(plan.memory.get(state, plan.memory["training"]).values()), state


def test_the_ledger_moves_terms_and_keeps_each_state_s_peak_by_hand():
    """Terms of 1, 2, 4, 8 and 16 bytes: the device total after each move, each state's peak and its terms, the
    host bytes (an offloaded copy, the pinned block kept once it came back, a host-only gather), the cap."""
    led = Ledger({"parameters": 1, "gradients": 2, "main_weights": 4, "moments": 8, "host_gather": 16,
                  "save_gather": 3}, cap=16)
    led.enter("start-up")
    led.build_trainer()  # parameters, gradients, main weights (no outside / nccl terms here)
    led.offload_training_state()  # gradients freed, main weights to host
    assert led.device_total() == 1 and led.host_total() == 4
    led.enter("training")
    led.onload_training_state()
    led.optimizer_step()  # the moments appear (activations are not terms of this ledger)
    assert led.device_total() == 15 and led.peaks["start-up"] == {"parameters": 1, "gradients": 2,
                                                                   "main_weights": 4}
    led.enter("save")
    led.offload_training_state(optimizer=False)  # gradients freed
    led.save()  # 3 on the device, 16 in host memory, for the write
    assert sum(led.peaks["save"].values()) == 1 + 4 + 8 + 3 and led.host_peaks["save"] == 4 + 16
    assert led.device_total() == 13 and led.host_total() == 4  # the main weights' pinned block stays
    led.enter("save")
    led.onload_training_state()  # a save with the gradients kept: 15 + its 3 passes the cap of 16
    with pytest.raises(LedgerOverflow, match=r"save: save actor puts .* GiB on the GPU, more than .*gradients"):
        led.save()
    assert led.trail[-1] == ("save", "save actor", 18)
