"""The rollout engine's sleep/wake state machine, driven by the real training loops.

``FakeVLLM`` models what vLLM 0.32 does with its memory and scheduler (sleep pauses the scheduler and
frees the KV cache, level 1 moves the weights to the host, level 2 discards them; the scheduler resumes
only once everything is awake again) and fails where vLLM would hang or generate from garbage: a generate
on a paused scheduler, a generate from discarded weights, a load into discarded memory, a wake-up without
the trainer's cached memory emptied first. The loops (``trainer.loop._train_loop``, ``trainer.sft._loop``)
run for real over in-process ``PolicyWorker``s whose Megatron parts are stubbed; their engine is the real
``EngineStateMachine`` over a ``FakeVLLM``. Each scenario checks the engine calls phase by phase against
the sequence the loop's phases must produce. CPU only, no Ray, no model: ~5 s in all.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megareason.config import load_config
from megareason.data.records import PromptRecord
from megareason.models.tiny import build_tokenizer
from megareason.rewards.scoring import SampleResult
from megareason.rollout.engine_state import EngineState, EngineStateError, EngineStateMachine
from megareason.rollout.records import Completion, GenerationStopped, WeightUpdate
from megareason.trainer.critic_worker import CriticWorker
from megareason.trainer.handles import critic_settings, policy_settings
from megareason.trainer.run_dir import RunDir
from megareason.trainer.stats import CriticStats, PolicyStats, SftStats
from megareason.trainer.workers import PolicyWorker


class FakeVLLM:
    """vLLM's sleep-mode semantics (see the module docstring); ``reply(prompt_text, k)`` writes the
    completions of the k-th generate call."""

    def __init__(self, tok, reply):
        self.tokenizer, self.reply = tok, reply
        self.weights, self.valid, self.kv, self.paused = "device", True, True, False
        self.calls: list[str] = []
        self.prompts: list[list[str]] = []  # the prompts of each generate call that completed
        self.should_stop = None  # as VLLMEngine's: asked while generating

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def sleep(self, level: int) -> None:
        assert self.weights == "device" and self.kv and not self.paused, "sleep on an engine not fully awake"
        self.calls.append(f"sleep{level}")
        self.paused, self.kv = True, False
        self.weights = "host" if level == 1 else "discarded"
        self.valid = level == 1

    def wake_up(self, tags=None) -> None:
        assert self.calls[-1] == "empty_cache", "woken without emptying the trainer's cached memory"
        tags = tags or ["weights", "kv_cache"]
        self.calls.append("wake:" + ",".join(tags))
        if "weights" in tags:
            assert self.weights != "device"
            self.weights = "device"
        if "kv_cache" in tags:
            assert not self.kv
            self.kv = True
        if self.weights == "device" and self.kv:
            self.paused = False  # vLLM resumes scheduling once fully awake

    def update_weights(self, named_tensors, bucket_bytes: int) -> WeightUpdate:
        assert self.weights == "device", "weights loaded into discarded memory"
        n = sum(t.numel() * t.element_size() for _, t in named_tensors)
        self.calls.append("sync")
        self.valid = True
        return WeightUpdate(bytes=n, buckets=1, largest_bucket=n, seconds=0.0, vllm_seconds=0.0)

    def generate(self, prompts_token_ids, sampling, use_tqdm: bool = True):
        if self.paused:
            raise AssertionError("generate on a sleeping vLLM: its scheduler is paused, LLM.generate would hang")
        assert self.valid, "generate from discarded weights"
        self.calls.append("gen")
        call = self.calls.count("gen") - 1
        out = []
        for ids in prompts_token_ids:
            text = self.reply(self.tokenizer.decode(ids), call)
            if self.should_stop is not None and self.should_stop():
                self.calls.append("stopped")
                raise GenerationStopped("generation stopped: the run is stopping")
            tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append([Completion(token_ids=tokens, text=text, logprobs_T=[-0.5] * len(tokens), finish_reason="stop")
                        for _ in range(sampling.n)])
        self.prompts.append([self.tokenizer.decode(ids) for ids in prompts_token_ids])
        return out

    def shutdown(self) -> None:
        pass


def _rows(worker, exp) -> torch.Tensor:
    """[B_share, T]: this replica's rows at the whole batch's width, as the real workers return them."""
    return torch.zeros(len(worker._share(exp)), exp.tokens_BT.shape[1])


def _stats(record, **extra):
    return record(loss=0.1, grad_norm=1.0, tokens=10, **extra)


class StubPolicy(PolicyWorker):
    """A PolicyWorker whose Megatron parts are stubs: generate, sleep_engine and sync_weights are real."""

    def __init__(self, cfg, rank: int, dp: int, tok, reply):
        super().__init__(policy_settings(cfg), rank, dp)
        self.layout = SimpleNamespace(dp=dp, dp_rank=rank, tp=1, tp_rank=0, pp=1, pp_rank=0)
        self.vllm = FakeVLLM(tok, reply)
        # the worker's own hook before a wake-up: trainer.offload_optimizer's offload, then empty_cache
        self.engine = EngineStateMachine(self.vllm, empty_cache=self._before_wake)
        self.engine_index, self.engine_leader = rank, True
        self.actor = SimpleNamespace(offload_training_state=lambda: self.vllm.calls.append("offload"))
        self.role = SimpleNamespace(load=lambda path: self.vllm.calls.append("load") or {})  # PolicyWorker.load

    def _empty_cache(self):
        self.vllm.empty_cache()

    def _hf_weights(self):
        yield "model.embed_tokens.weight", torch.ones(4, 2)

    def logprobs(self, exp):
        return _rows(self, exp), _rows(self, exp)

    def ref_logprobs(self, exp):
        return _rows(self, exp)

    def train(self, exp, lr, on_policy, stoppable=False):
        mismatch = {"mismatch_sum": 10.0, "logp_diff_max": 0.0} if on_policy else {}
        return _stats(PolicyStats, pg_loss_num=0.0, pg_loss_den=1, clipfrac_sum=0.0, ppo_kl_sum=0.0, entropy_sum=1.0,
                      **mismatch)

    def sft_train(self, exp, lr):
        return _stats(SftStats, nll_num=1.0, nll_den=1)

    def _write_checkpoint(self, path, metadata, asynchronous):
        assert not self.vllm.kv and self.vllm.weights != "device", "a checkpoint written beside an awake engine"
        self.vllm.calls.append("save")

    def shutdown(self):
        pass


class StubCritic(CriticWorker):
    def __init__(self, cfg, rank: int, dp: int):
        super().__init__(critic_settings(cfg), rank, dp)
        self.layout = SimpleNamespace(dp=dp, dp_rank=rank, tp=1, tp_rank=0, pp=1, pp_rank=0)

    def values(self, exp):
        return _rows(self, exp)

    def train(self, exp, lr):
        return _stats(CriticStats, vf_loss_num=0.0, vf_loss_den=1, vf_clipfrac_sum=0.0, vpred_sum=0.0)

    def save(self, path, metadata, asynchronous=False):
        pass

    def load(self, path):
        return {}

    def shutdown(self):
        pass


class InProcessGroup:
    """``WorkerGroup``'s interface over workers in this process."""

    def __init__(self, name, workers):
        self.name, self.workers = name, workers
        self.first_of_replica = list(range(len(workers)))

    def call(self, method, *args):
        return [getattr(w, method)(*args) for w in self.workers]

    def replicas(self, results):
        return [results[i] for i in self.first_of_replica]

    def engine_leaders(self):
        return self.first_of_replica

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


CALL = '<tool_call>{"name": "search", "arguments": {"query": "founder"}}</tool_call>'


def _reply(text: str, call: int, garbage_call: int = -1) -> str:
    """An environment episode searches once, then answers; the RARO critic says A (or nothing parseable
    in generate call ``garbage_call``); the policy answers."""
    if "Verdict: A" in text:  # the critic's instructions
        return "I cannot tell." if call == garbage_call else "Both look fine.\nVerdict: A"
    if CALL in text:
        return "<answer>Ada</answer>"
    return CALL if "search" in text else "<answer>2</answer>"


def _cfg(name: str, overrides: list[str]):
    return load_config(name, ["trainer.steps=2", "trainer.prompts_per_step=2", "trainer.val_every=1",
                              "trainer.val_before_train=true", "trainer.save_every=0", "trainer.loggers=[]",
                              "rollout.n=2", *overrides])


def _prompts(tok, n: int, question: str = "What is {i} + 1?", **extra):
    from megareason.data.prompts import tokenize_prompts

    records = [PromptRecord(prompt=[{"role": "user", "content": question.format(i=i)}], data_source="arithmetic",
                            ground_truth=str(i + 1), extra_info={"index": i, **extra}) for i in range(n)]
    return tokenize_prompts(records, tok, 512, "filter")


def _score(batch, completions):
    return [SampleResult(index=i, sample=j, data_source=p.record.data_source, question="q",
                         ground_truth=p.record.ground_truth, response=c.text, reward=float(j % 2), correct=j % 2 == 1,
                         response_tokens=len(c.token_ids), truncated=c.truncated)
            for i, (p, group) in enumerate(zip(batch, completions, strict=True)) for j, c in enumerate(group)]


def _run(cfg, tmp_path, prompts, val, tok, dp: int = 1, reply=_reply, score=_score, stop=None, started=None):
    from megareason.trainer.loop import _train_loop

    cfg = replace(cfg, parallel=replace(cfg.parallel, data_parallel_size=dp))
    actors = InProcessGroup("actor", [StubPolicy(cfg, r, dp, tok, reply) for r in range(dp)])
    groups = [actors]
    if cfg.algorithm.name == "ppo":
        groups.append(InProcessGroup("critic", [StubCritic(cfg, r, dp) for r in range(dp)]))
    if started is not None:  # the workers, also when the loop raises
        started.append(actors)
    _train_loop(cfg, RunDir(str(tmp_path)), groups, prompts, val, score, tok, stop=stop)
    return actors


def _phases(worker: StubPolicy) -> list[str]:
    """The engine calls, empty_cache folded into the wake-up it precedes (FakeVLLM checks the pairing)."""
    return [c for c in worker.vllm.calls if c not in ("empty_cache", "offload")]


def _check_machine(worker: StubPolicy) -> None:
    """The state machine's own record: generate only when awake, every wake-up right after empty_cache,
    level-2 sleeps before Megatron computes (every update ends with a sync), level 1 only for a checkpoint
    (the engine keeps the synced weights); the run ends with the last step's checkpoint."""
    events = worker.engine.events
    assert all(e.state is EngineState.AWAKE for e in events if e.kind == "generate")
    for i, e in enumerate(events):
        if e.kind == "wake_up":
            assert events[i - 1].kind == "empty_cache"
    sleeps = [c for c in worker.vllm.calls if c.startswith("sleep")]
    levels = [c for i, c in enumerate(worker.vllm.calls) if c == "sleep1" and worker.vllm.calls[i + 1] == "save"]
    assert len(levels) == sleeps.count("sleep1") and len(sleeps) == sleeps.count("sleep2") + len(levels)
    assert worker.engine.state is EngineState.ASLEEP_WEIGHTS and worker.vllm.calls[-1] == "save"


VAL = ["gen"]
UPDATE = ["sleep2", "wake:weights", "sync", "wake:kv_cache"]
SAVE = ["sleep1", "save"]  # every checkpoint is written with the engine asleep, its weights in host memory
WAKE = ["wake:weights,kv_cache"]  # the generate after a checkpoint


def test_offload_optimizer_leaves_the_gpu_before_every_wake_up_and_only_then(tok, tmp_path):
    """trainer.offload_optimizer: the actor's gradients and optimizer state leave the device right before each
    engine wake-up (the weights' before the sync, the KV cache's after it, a checkpointed engine's before
    the next generate), never otherwise; without it, never."""
    for on in (True, False):
        cfg = _cfg("grpo_smollm2_cpu", [f"trainer.offload_optimizer={str(on).lower()}", "trainer.save_every=1"])
        (w,) = _run(cfg, tmp_path / str(on), _prompts(tok, 4), _prompts(tok, 2), tok).workers
        calls = w.vllm.calls
        wakes = [i for i, c in enumerate(calls) if c.startswith("wake")]
        assert wakes and all(calls[i - 1] == "empty_cache" for i in wakes)
        if on:
            assert all(calls[i - 2] == "offload" for i in wakes)
            assert calls.count("offload") == len(wakes)
        else:
            assert "offload" not in calls
        assert _phases(w) == VAL + ["gen"] + UPDATE + VAL + SAVE + WAKE + ["gen"] + UPDATE + VAL + SAVE


@pytest.mark.parametrize("dp", [1, 2])
def test_grpo_steps_and_validation_never_generate_while_asleep_and_resume_syncs(tok, tmp_path, dp):
    cfg = _cfg("grpo_smollm2_cpu", ["algorithm.kl_coef=0.01", "trainer.save_every=2"])
    prompts, val = _prompts(tok, 4), _prompts(tok, 2)
    actors = _run(cfg, tmp_path, prompts, val, tok, dp)
    for w in actors.workers:
        assert _phases(w) == VAL + (["gen"] + UPDATE + VAL) * 2 + SAVE  # step 2: the last, and save_every=2
        _check_machine(w)
    # Resume from step 2's checkpoint: the fresh engines sleep while the checkpoint loads (its optimizer state
    # fills the device), then take the trained weights through the step's own wake-up path.
    cfg3 = replace(cfg, trainer=replace(cfg.trainer, steps=3))
    actors = _run(cfg3, tmp_path, prompts, val, tok, dp)
    for w in actors.workers:
        assert _phases(w) == ["sleep2", "load"] + UPDATE[1:] + ["gen"] + UPDATE + VAL + SAVE
        _check_machine(w)


def test_ppo_off_policy_epochs_sleep_once_per_update(tok, tmp_path):
    cfg = _cfg("ppo_smollm2_cpu", ["algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "trainer.val_every=0",
                                   "trainer.val_before_train=false", "trainer.save_every=1"])
    actors = _run(cfg, tmp_path, _prompts(tok, 4), _prompts(tok, 2), tok)
    (w,) = actors.workers
    # Step 1's checkpoint puts the synced engine to sleep; step 2's generate wakes it; validation after the
    # last step, then its checkpoint.
    assert _phases(w) == ["gen"] + UPDATE + SAVE + WAKE + ["gen"] + UPDATE + VAL + SAVE
    _check_machine(w)


def test_raro_generates_twice_per_step_and_a_skipped_update_leaves_the_engine_awake(tok, tmp_path):
    # Generate calls: 0 validation, 1-2 step 1 (policy, critic), 3 validation, 4-5 step 2: the critic's
    # verdicts in call 5 are unparseable, so every row is masked and step 2's update is skipped.
    cfg = _cfg("raro_smollm2_cpu", ["trainer.steps=3", "raro.critic_n=2", "raro.replay_buffer_ratio=0.0",
                                    "raro.constrain_verdict_chars=0"])
    actors = _run(cfg, tmp_path, _prompts(tok, 4), _prompts(tok, 2), tok,
                  reply=lambda text, call: _reply(text, call, garbage_call=5))
    (w,) = actors.workers
    raro_step = ["gen", "gen"]
    assert _phases(w) == VAL + (raro_step + UPDATE + VAL) + (raro_step + VAL) + (raro_step + UPDATE + VAL) + SAVE
    _check_machine(w)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "actor/loss" in m] == [1, 3]  # independent: step 2 trained nothing


def test_multi_turn_environment_episodes_generate_once_per_turn_on_an_awake_engine(tok, tmp_path):
    from megareason.data.loaders import load_records
    from megareason.data.prompts import tokenize_prompts

    cfg = _cfg("grpo_multihop_cpu", ["env.initial_search=false", "env.max_turns=3"])
    d = cfg.data
    records = load_records(replace(d, sources=[replace(d.sources[0], size=6)]))
    prompts = tokenize_prompts(records, tok, 4096, "error")
    actors = _run(cfg, tmp_path, prompts[:4], prompts[4:], tok)
    (w,) = actors.workers
    episode = ["gen", "gen"]  # a search, then the answer
    assert _phases(w) == episode + (episode + UPDATE + episode) * 2 + SAVE
    _check_machine(w)


def test_dynamic_sampling_draws_again_on_an_awake_engine_until_groups_are_informative(tok, tmp_path):
    # DAPO: the first batch's groups are all-equal (no gradient), so the step draws the next prompts (on the
    # engine, still awake) and trains on those two informative groups only.
    calls = []

    def score(batch, completions):
        calls.append(len(batch))
        rows = _score(batch, completions)
        return [replace(r, reward=1.0) for r in rows] if len(calls) == 1 else rows

    cfg = _cfg("grpo_smollm2_cpu", ["trainer.steps=1", "trainer.val_every=0", "trainer.val_before_train=false",
                                    "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_tries=3"])
    actors = _run(cfg, tmp_path, _prompts(tok, 6), _prompts(tok, 2), tok, score=score)
    (w,) = actors.workers
    assert _phases(w) == ["gen", "gen"] + UPDATE + VAL + SAVE  # two draws, one update; validation at the end
    _check_machine(w)
    (m,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (m["dapo/tries"], m["dapo/informative_groups"], m["dapo/drawn_groups"]) == (2, 2, 4)
    assert calls == [2, 2, 2]  # two draws of prompts_per_step prompts, then the validation's


def test_dynamic_sampling_out_of_tries_warns_and_skips_an_update_without_rows(tok, tmp_path, caplog):
    def score(batch, completions):
        return [replace(r, reward=0.0) for r in _score(batch, completions)]

    cfg = _cfg("grpo_smollm2_cpu", ["trainer.steps=1", "trainer.val_every=0", "trainer.val_before_train=false",
                                    "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_tries=2"])
    actors = _run(cfg, tmp_path, _prompts(tok, 6), _prompts(tok, 2), tok, score=score)
    (w,) = actors.workers
    assert _phases(w) == ["gen", "gen"] + VAL + SAVE  # nothing to train on: no sleep for Megatron, no sync
    (m,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (m["dapo/tries"], m["dapo/informative_groups"]) == (2, 0) and "actor/loss" not in m
    assert "dynamic sampling found 0 of 2 informative groups in 2 batches" in caplog.text


def test_sft_sleeps_before_megatron_and_its_validation_syncs_then_generates(tok, tmp_path):
    from megareason.trainer.sft import _loop

    cfg = _cfg("sft_smollm2_cpu", [])
    prompts = _prompts(tok, 4)
    answers = [Completion(token_ids=tok.encode("2", add_special_tokens=False), text="2", logprobs_T=[0.0],
                          finish_reason="stop") for _ in prompts]
    actors = InProcessGroup("actor", [StubPolicy(cfg, 0, 1, tok, _reply)])
    _loop(cfg, RunDir(str(tmp_path)), actors, (prompts, answers), (prompts[:2], answers[:2]), _score)
    (w,) = actors.workers
    validation = UPDATE + ["gen"]  # Megatron's validation loss, then the sync and the greedy answers
    # step 1 puts the engine to sleep (awake after validation), then its own validation
    assert _phases(w) == validation + validation * 2 + SAVE
    _check_machine(w)


def _run_stopped_in_generate(cfg, out, prompts, val, tok, call: int) -> StubPolicy:
    """A run that gets a SIGTERM (a real signal to this process) in its generate call ``call`` and exits
    with EXIT_STOPPED; its worker."""
    import os
    import signal

    from megareason.trainer.driver import EXIT_STOPPED, stop_signals

    sent, started = [], []

    def reply(text, k):
        if k == call and not sent:  # the call's first prompt
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return _reply(text, k)

    with stop_signals() as stop, pytest.raises(SystemExit) as stopped:
        _run(cfg, out, prompts, val, tok, reply=reply, stop=stop, started=started)
    assert stopped.value.code == EXIT_STOPPED
    (worker,) = started[0].workers
    return worker


def test_a_sigterm_during_generation_drops_the_step_saves_the_one_before_and_the_resume_repeats_it(tok, tmp_path):
    """A SIGTERM (a real signal to this process) while step 3 generates: the engine gives up at once (the
    driver's stop file), the step is dropped, step 2's state is saved (no checkpoint held it yet) with the
    engine asleep, and the run exits with 75. The next run does steps 3 and 4 on the prompts an uninterrupted
    run gives them: the saved prompt order is the one from before step 3 drew its prompts."""
    cfg = _cfg("grpo_smollm2_cpu", ["trainer.steps=4", "trainer.val_every=0", "trainer.val_before_train=false"])
    prompts, val = _prompts(tok, 5), _prompts(tok, 2)  # 5 prompts: step 3 draws across an epoch boundary
    (straight,) = _run(cfg, tmp_path / "straight", prompts, val, tok).workers

    out = tmp_path / "stopped"
    interrupted = _run_stopped_in_generate(cfg, out, prompts, val, tok, call=2)  # step 3's
    assert RunDir(str(out)).steps() == [2]
    assert _phases(interrupted) == ["gen"] + UPDATE + ["gen"] + UPDATE + ["gen", "stopped"] + SAVE
    assert (out / ".stopping").exists()
    (resumed,) = _run(cfg, out, prompts, val, tok).workers
    assert RunDir(str(out)).steps() == [2, 4] and not (out / ".stopping").exists()  # the new run removed it
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the dropped step logged nothing
    assert interrupted.vllm.prompts + resumed.vllm.prompts == straight.vllm.prompts  # steps 1-4, then validation


def test_a_sigterm_during_validation_saves_the_step_and_the_next_run_validates_it_first(tok, tmp_path):
    """A SIGTERM while step 2's validation generates: the update is done, so step 2 is saved (with its
    metrics, waiting for their validation) and the run exits with 75; the next run validates step 2 first,
    logs its row, and goes on: every row has what an uninterrupted run's has, validation included."""
    cfg = _cfg("grpo_smollm2_cpu", ["trainer.steps=3", "trainer.val_every=2", "trainer.val_before_train=false"])
    prompts, val = _prompts(tok, 4), _prompts(tok, 2)
    _run(cfg, tmp_path / "straight", prompts, val, tok)
    out = tmp_path / "stopped"
    interrupted = _run_stopped_in_generate(cfg, out, prompts, val, tok, call=2)  # step 1, step 2, its validation
    assert RunDir(str(out)).steps() == [2]
    assert _phases(interrupted) == ["gen"] + UPDATE + ["gen"] + UPDATE + ["gen", "stopped"] + SAVE
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    (resumed,) = _run(cfg, out, prompts, val, tok).workers
    assert _phases(resumed) == ["sleep2", "load"] + UPDATE[1:] + VAL + ["gen"] + UPDATE + VAL + SAVE  # step 2's val

    def rows(folder):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/"))}
                for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert rows(out) == rows(tmp_path / "straight") and "val/accuracy" in rows(out)[1]


# --- the state machine alone: error paths ---------------------------------------------------------


class Broken(FakeVLLM):
    def __init__(self, tok, fail: str):
        super().__init__(tok, _reply)
        self.fail = fail

    def update_weights(self, named_tensors, bucket_bytes):
        if self.fail == "update":
            self.valid = False  # a part-way load: a mix of old and new weights
            raise ValueError("weight sync: tensor 'x' has shape (1,), the served model expects (2,)")
        return super().update_weights(named_tensors, bucket_bytes)

    def sleep(self, level):
        if self.fail == "sleep":
            raise RuntimeError("CUDA error")
        super().sleep(level)


def _machine(engine):
    return EngineStateMachine(engine, empty_cache=engine.empty_cache)


def test_a_failed_sync_leaves_the_engine_stale_until_a_sync_succeeds(tok):
    from megareason.rollout.records import Sampling

    fake = Broken(tok, "update")
    m = _machine(fake)
    m.sleep(2)
    with pytest.raises(EngineStateError, match="asleep_all: its weights were discarded .* sync weights first"):
        m.generate([[1, 2]], Sampling(max_tokens=4))
    with pytest.raises(ValueError, match="served model expects"):
        m.update_weights([("w", torch.ones(2))], 1 << 20)
    assert m.state is EngineState.STALE
    with pytest.raises(EngineStateError, match="stale: a weight sync failed part-way"):
        m.generate([[1, 2]], Sampling(max_tokens=4))
    fake.fail = ""
    m.update_weights([("w", torch.ones(2))], 1 << 20)  # wakes the KV cache still asleep from the sleep
    assert m.state is EngineState.AWAKE and fake.kv and not fake.paused
    m.generate([[1, 2]], Sampling(max_tokens=4))
    # A stale engine put to sleep goes to level 2 (nothing worth keeping), from a fully awake engine.
    fake.fail = "update"
    with pytest.raises(ValueError):
        m.update_weights([("w", torch.ones(2))], 1 << 20)
    m.sleep(1)
    assert m.state is EngineState.ASLEEP_ALL and fake.weights == "discarded"


def test_level_one_sleep_wakes_for_generate_and_a_failed_sleep_refuses_everything(tok):
    from megareason.rollout.records import Sampling

    fake = FakeVLLM(tok, _reply)
    m = _machine(fake)
    m.sleep(1)
    m.sleep(2)  # already asleep: stays (level 1, weights in host memory)
    assert m.state is EngineState.ASLEEP_WEIGHTS
    m.generate([[1, 2]], Sampling(max_tokens=4))
    assert fake.calls == ["sleep1", "empty_cache", "wake:weights,kv_cache", "gen"]
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 0"):
        m.sleep(0)
    broken = Broken(tok, "sleep")
    m = _machine(broken)
    with pytest.raises(RuntimeError, match="CUDA error"):
        m.sleep(2)
    assert m.state is EngineState.FAILED
    for call in (lambda: m.generate([[1]], Sampling()), lambda: m.update_weights([], 1), m.wake_up):
        with pytest.raises(EngineStateError, match="failed: a sleep or wake-up failed .* restart the engine"):
            call()


class FakePool:
    """The separate rollout pool as one step off-policy uses it, recording into ``calls``: batches launched
    (``generate_async``) and waited for, validation's generate; the completions are ``FakeVLLM``'s."""

    def __init__(self, tok, calls: list[str]):
        self.engine, self.calls = FakeVLLM(tok, _reply), calls

    def remote_engines(self):
        return None

    def generate(self, prompt_ids, sampling):
        self.calls.append("val")
        return self.engine.generate(prompt_ids, sampling)

    def generate_async(self, prompt_ids, sampling):
        self.calls.append("launch")
        out, calls = self.engine.generate(prompt_ids, sampling), self.calls

        class Pending:
            def result(self):
                calls.append("wait")
                return out, 0.0

        return Pending()


class PoolPolicy(StubPolicy):
    """A policy rank beside a separate pool: no engine of its own; the weight push and the update recorded."""

    def __init__(self, cfg, tok, calls: list[str]):
        super().__init__(cfg, 0, 1, tok, _reply)
        self.engine, self.calls = None, calls

    def attach_engines(self, remote):
        pass

    def sync_weights(self):
        self.calls.append("push")
        return WeightUpdate(bytes=8, buckets=1, largest_bucket=8, seconds=0.0, vllm_seconds=0.0)

    def train(self, exp, lr, on_policy, stoppable=False):
        self.calls.append("train")
        return super().train(exp, lr, on_policy)

    def _write_checkpoint(self, path, metadata, asynchronous):
        self.calls.append("save")


def test_one_step_off_launches_the_next_batch_before_training_and_settles_before_validation(tok, tmp_path):
    """trainer.max_staleness=1: each step waits for its batch, launches the next before the update (trained
    on while it generates), and before validation waits for it and pushes the newest weights; a checkpoint
    keeps the batch in flight (rollout_inflight.pt) once it is done."""
    from megareason.trainer.loop import _train_loop
    from megareason.trainer.offpolicy import INFLIGHT

    cfg = _cfg("grpo_smollm2_cpu", ["trainer.max_staleness=1", "rollout.placement=separate", "trainer.save_every=1"])
    calls: list[str] = []
    actors = InProcessGroup("actor", [PoolPolicy(cfg, tok, calls)])
    _train_loop(cfg, RunDir(str(tmp_path)), [actors], _prompts(tok, 4), _prompts(tok, 2), _score, tok,
                engines=FakePool(tok, calls))
    assert calls == ["val",  # before training, on the initial weights
                     "launch", "wait", "launch", "train",  # step 1: its batch, then step 2's launched
                     "wait", "push", "val", "save",  # step 2's batch done, step 1's weights pushed
                     "train", "push", "val", "save"]  # step 2 trains on its batch (generated meanwhile)
    checkpoints = RunDir(str(tmp_path)).checkpoints
    assert (checkpoints / "step_00000001" / INFLIGHT).is_file()
    assert not (checkpoints / "step_00000002" / INFLIGHT).exists()  # the last step has nothing in flight
