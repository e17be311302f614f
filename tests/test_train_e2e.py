"""`megareason train` end to end on a tiny model: Ray, vLLM, megatron-core, the real loop.

The tiny random model never solves a reasoning task, so these runs score responses with a custom
reward (the share of vowels in the response) that varies from sample to sample: advantages, losses
and gradients are then nonzero and comparisons between runs mean something.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden_curves import check_golden

from megareason.ports import PORT_BASE_ENV, RENDEZVOUS, run_block

pytestmark = pytest.mark.slow

REWARD = """\
def vowels(data_source, response, ground_truth, extra_info):
    return sum(ch in "aeiou" for ch in response) / max(len(response), 1)
"""


def _args(model: Path, tmp: Path, out: Path, *extra: str) -> list[str]:
    reward = tmp / "reward.py"
    reward.write_text(REWARD)
    return [sys.executable, "-m", "megareason.cli", "train", f"model.path={model}", f"trainer.output_dir={out}",
            f"reward.custom={reward}:vowels", "trainer.steps=4", "trainer.prompts_per_step=4", "rollout.n=4",
            "rollout.max_tokens=24", "rollout.max_model_len=256", "data.max_prompt_length=128",
            "trainer.micro_batch_tokens=256", "optim.lr=1e-3", "trainer.val_before_train=false",
            "data.sources=[{kind: reasoning_gym, name: basic_arithmetic, size: 16}]",
            "data.val_sources=[{kind: reasoning_gym, name: basic_arithmetic, size: 4, seed: 9}]", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def _run(args: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return str(pid)


def _started_by(proc: subprocess.Popen, engines: bool = True) -> dict[int, tuple[int, str]]:
    """The processes the driver started (pid -> (start time, name)): Ray's, the workers', vLLM's (``engines``:
    its engines must be among them)."""
    from megareason.launch.reaper import descendants, process_table

    started = {pid: (start, _comm(pid)) for pid, start in descendants({proc.pid}, process_table()).items()}
    names = {name for _, name in started.values()}
    assert "raylet" in names and (not engines or any(n.startswith("VLLM") for n in names)), names
    return started


def _expect_gone(started: dict[int, tuple[int, str]], after: str, within: float = 20.0) -> None:
    from megareason.launch.reaper import alive

    deadline = time.time() + within
    while (left := sorted(name for p, (s, name) in started.items() if alive(p, s))) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind {within:.0f} s after {after}: {left}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the driver, then everything left in the session it leads (Ray workers put themselves, and the
    vLLM engines they start, in process groups of their own): a cleanup that never leaves a process."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: nothing left
        pass
    proc.wait(timeout=60)
    deadline = time.time() + 30
    while time.time() < deadline:
        left = [int(p) for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) == proc.pid]
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"processes of the killed run survive: {left}")


# How large models train: bf16 mixed precision, the distributed optimizer over 2 data-parallel
# ranks and full activation recomputation; the vLLM engines generate in fp32.
AT_SCALE = ("trainer.precision=bf16", "optim.use_distributed_optimizer=true", "parallel.data_parallel_size=2",
            "trainer.recompute=full", "trainer.save_every=2")


def test_a_bad_setup_exits_2_before_any_worker_starts(tiny_qwen2, tmp_path):
    """The command line's side of a refusal (each refusal's own check: test_refusals.py, in process)."""
    args = _args(tiny_qwen2, tmp_path, tmp_path / "bad", "model.path=/nonexistent/model")
    proc = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: " in proc.stderr and "/nonexistent/model" in proc.stderr
    assert "PolicyWorker" not in proc.stderr  # no worker was started


# TRL's conversational form, which the rows' chat prompts select without a switch (reward.trl_format=auto)
TRL_REWARD = """\
def consonants(prompts, completions, solution, **kwargs):
    assert len(prompts) == len(completions) == len(solution) and all(isinstance(p, list) for p in prompts)
    return [sum(ch in "bcdfg" for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]
"""


def _tutorial_files(page: str, where: Path) -> None:
    """The ```python title=FILE blocks of docs/``page`` written into ``where``, and its make_*.py run there."""
    from test_tutorials import _blocks

    for lang, title, text in _blocks(f"docs/{page}"):
        if lang == "python" and title:
            (where / title).write_text(text)
            if title.startswith("make_"):
                subprocess.run([sys.executable, title], cwd=where, check=True, timeout=120)


def _hub_snapshot(cache: Path, repo_type: str, repo_id: str, files: Path) -> None:
    """``files`` as the cached revision ``main`` of ``repo_id`` in a Hugging Face Hub cache."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(files, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_reinforce_pp_on_a_hub_model_and_hub_data_with_verl_and_trl_rewards_beside_a_built_in(tiny_qwen2, tmp_path):
    """What a verl or TRL user brings, in one run: the model as a Hub id and a Hub data set in verl's row
    format (both from a Hugging Face cache, offline), TRL prompt-only rows, a verl-signature and a TRL batch
    reward routed by data source beside the built-in gsm8k reward. The algorithm: REINFORCE++-baseline with the
    KL in the reward (off-policy old log-probs) and as a loss term too, token-level TIS, Dr. GRPO's constant
    normaliser. (GSPO, MIS and DAPO: the colocated TP 2 run.)"""
    cache = tmp_path / "hf_hub"
    _hub_snapshot(cache, "model", "tiny-org/tiny-qwen2", tiny_qwen2)
    verl_rows = tmp_path / "gsm8k" / "data"
    verl_rows.mkdir(parents=True)
    (verl_rows / "train.jsonl").write_text("".join(json.dumps({
        "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
        "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
        "extra_info": {"split": "train", "index": a}}) + "\n" for a in range(4)))
    _hub_snapshot(cache, "dataset", "tiny-org/tiny-gsm8k", tmp_path / "gsm8k")
    # the tutorials' files: docs/from_verl.md's reward function, docs/from_trl.md's conversational math rows
    _tutorial_files("from_verl.md", tmp_path)
    _tutorial_files("from_trl.md", tmp_path)
    trl = tmp_path / "math.jsonl"
    (tmp_path / "trl_reward.py").write_text(TRL_REWARD)
    out = tmp_path / "alg"
    args = [a for a in _args(tiny_qwen2, tmp_path, out) if not a.startswith(("reward.custom=", "model.path="))]
    block = run_block(os.getpid() + 1)  # not the block this test process's own stores use
    proc = _run([*args, "model.path=tiny-org/tiny-qwen2", "trainer.steps=2", "trainer.prompts_per_step=6",
          "trainer.save_every=0", "trainer.val_every=0", "data.val_sources=[]",
          "data.sources=[{kind: hf, name: tiny-org/tiny-gsm8k}, "
          f"{{kind: file, path: {trl}, size: 4, data_source: trl_consonants}}, "
          "{kind: reasoning_gym, name: basic_arithmetic, size: 4, data_source: vowels_verl}]",
          f"reward.by_source={{vowels_verl: {tmp_path / 'my_reward.py'}:my_reward_fn, "
          f"trl_consonants: {tmp_path / 'trl_reward.py'}:consonants}}",
          "algorithm.name=reinforce_pp_baseline", "algorithm.kl_coef=0.01",
          "algorithm.kl_in_reward=true", "algorithm.kl_loss_coef=0.01",
          "algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.rollout_tis_cap=2.0"],
         env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", PORT_BASE_ENV: str(block)})
    # Each role's process group met at a store on the first free rendezvous port of the run's block, below
    # the ephemeral range (megareason/ports.py).
    stores = [int(p) for p in re.findall(r"rendezvous at 127\.0\.0\.1:(\d+)", proc.stdout + proc.stderr)]
    assert stores and all(block <= p < block + RENDEZVOUS for p in stores), (block, stores)
    m = _metrics(out)
    assert sorted(m) == [1, 2] and all(m[s]["actor/grad_norm"] > 0 for s in (1, 2))
    for key in ("actor/is_ratio", "actor/is_ratio_max", "actor/is_kl", "actor/is_truncated", "actor/kl"):
        assert key in m[1] and key in m[2], key
    # fp32 training against fp32 generation: the correction's ratios are ~1 and nothing is cut
    assert all(abs(m[s]["actor/is_ratio"] - 1) < 1e-3 and m[s]["actor/is_truncated"] == 0 for s in (1, 2))
    # every source trained (two steps of 6 prompts: the 12 rows once), each scored by its own function
    from megareason.rewards.registry import compute_score

    rows = [json.loads(x) for s in (1, 2)
            for x in (out / "rollouts" / f"step_{s:08d}.jsonl").read_text().splitlines()]
    assert {r["data_source"] for r in rows} == {"openai/gsm8k", "trl_consonants", "vowels_verl"}
    assert not any(r["score_error"] for r in rows) and all(m[s].get("reward/errors", 0) == 0 for s in (1, 2))
    def share(text: str, letters: str) -> float:
        return sum(ch in letters for ch in text) / max(len(text), 1)

    for r in rows:
        text, source = r["response"], r["data_source"]
        expected = (len(text) / 100 if source == "vowels_verl" else share(text, "bcdfg")
                    if source == "trl_consonants" else compute_score("gsm8k", text, r["ground_truth"], {}).score)
        assert r["reward"] == pytest.approx(expected, abs=1e-9), r
    # the start-up table, in the run folder: which reward scores which rows, and how
    table = (out / "data.txt").read_text()
    assert "trl_reward.py:consonants (TRL signature, conversational)" in table, table
    assert "my_reward.py:my_reward_fn (verl signature, per sample)" in table and "built-in gsm8k" in table
    assert "reward_errors" not in proc.stdout + proc.stderr


def _raro_args(model: Path, tmp: Path, out: Path, *extra: str) -> list[str]:
    # The tiny model's critic is constrained to end with a verdict line (raro.constrain_verdict_chars:
    # 12 characters, up to 4 byte-level tokens each, fit in 64 tokens with the verdict),
    # and its policy answers stop at the first "e" (so they are not cut at max_tokens and filtered).
    return _args(model, tmp, out, "algorithm.name=raro", "raro.critic_n=2", "raro.critic_max_tokens=64",
                 "raro.constrain_verdict_chars=12", "raro.policy_system_prompt=Answer briefly.",
                 "raro.critic_system_prompt='Which answer is the expert one? End with Verdict: A, B or Tie.'",
                 "rollout.stop=[e]", "rollout.max_model_len=1024", "trainer.micro_batch_tokens=1024",
                 "data.max_prompt_length=512", "raro.replay_buffer_size=6", "raro.replay_buffer_kind=reservoir",
                 "data.sources=[{kind: reasoning_gym, name: countdown, size: 16, options: {min_numbers: 3, "
                 "max_numbers: 3, min_target: 10, max_target: 60, max_value: 20}}]",
                 "data.val_sources=[{kind: reasoning_gym, name: countdown, size: 4, seed: 9, options: "
                 "{min_numbers: 3, max_numbers: 3, min_target: 10, max_target: 60, max_value: 20}}]", *extra)


def test_raro_with_lora_trains_logs_its_metrics_and_resumes_with_its_replay_buffer(tiny_qwen2, tmp_path):
    """RARO on LoRA adapters: two generate passes a step (policy, then critic), both from the merged weights
    synced after each update; its metrics, its critic's judgements, and a resume that restores the replay
    buffer and the adapters (with their optimizer state) exactly. (Full-parameter training: every other run.)
    The step-2 checkpoint it resumes from was written in the background (trainer.async_save) while step 3
    ran; the last step's, at once."""
    straight = tmp_path / "straight"
    lora = ("--use-lora", "lora.rank=4", "optim.lr=3e-2", "trainer.steps=3", "trainer.save_every=2",
            "trainer.async_save=true")
    first = _run(_raro_args(tiny_qwen2, tmp_path, straight, *lora))
    assert re.search(r"checkpoint of step 2: copied to host memory in [\d.]+ s, written in the background",
                     first.stderr), first.stderr[-3000:]
    assert re.search(r"checkpoint of step 2 saved in the background in [\d.]+ s", first.stderr)
    assert re.search(r"checkpoint of step 3 saved in [\d.]+ s", first.stderr)
    reference = _metrics(straight)
    check_golden("raro", reference)
    assert sorted(reference) == [1, 2, 3]
    for key in ("raro/critic_accuracy", "raro/tie_rate", "raro/format_error_rate", "raro/policy_fool_rate",
                "raro/expert_win_rate", "raro/buffer_size", "raro/critic_fresh", "raro/critic_historical",
                "raro/historical_fraction", "accuracy", "reward/mean", "reward/masked_rate", "actor/grad_norm",
                "rollout/token_mult_prob_error"):
        assert key in reference[3], key
    assert all(reference[s]["raro/format_error_rate"] == 0 for s in (1, 2, 3))  # constrained verdicts
    # RARO's order: the step's triplets enter the buffer (capacity 6) before the historical half is drawn.
    assert reference[1]["raro/critic_historical"] == min(reference[1]["raro/critic_fresh"], 6) > 0
    assert reference[3]["raro/buffer_size"] == 6  # full: capacity 6 < the triplets of three steps
    assert reference[2]["actor/grad_norm"] > 1e-4
    lines = (straight / "rollouts" / "step_00000002_critic.jsonl").read_text().splitlines()
    judgements = [json.loads(x) for x in lines]
    assert len(judgements) == 2 * (reference[2]["raro/critic_fresh"] + reference[2]["raro/critic_historical"])
    assert all("Verdict: " in j["judgement"] and j["expert_shown_as"] in ("A", "B") for j in judgements)
    meta = json.loads((straight / "checkpoints" / "step_00000002" / "actor" / "megareason.json").read_text())
    assert meta["lora"]["rank"] == 4
    # the replay buffer is RARO's algorithm state, saved in the trainer state
    state = json.loads((straight / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    state = state["extra"]["raro_replay"]
    assert state["seen"] == reference[1]["raro/critic_fresh"] + reference[2]["raro/critic_fresh"]

    # The run as it stood after its step-2 checkpoint (step 3's checkpoint removed; its metrics, rollouts and
    # curves are what an interrupted run leaves behind), resumed for step 3: the same step 3, replay buffer
    # included, and step 3 logged once.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    proc = _run(_raro_args(tiny_qwen2, tmp_path, resumed, *lora))
    assert "resuming from" in proc.stderr and "step_00000002" in proc.stderr
    rows = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows if "raro/critic_accuracy" in r] == [1, 2, 3]
    again = _metrics(resumed)
    for key in ("actor/loss", "actor/grad_norm", "reward/mean", "raro/critic_accuracy", "raro/tie_rate",
                "raro/critic_historical", "raro/buffer_size"):
        assert again[3][key] == reference[3][key], (key, again[3][key], reference[3][key])
    plots = subprocess.run([sys.executable, "-m", "megareason.cli", "report", str(straight)], capture_output=True,
                           text=True, env=_env(), timeout=120)
    assert plots.returncode == 0, plots.stderr
    assert (straight / "plots" / "raro.png").stat().st_size > 1000


def test_grpo_on_the_retrieval_qa_environment(tiny_qwen2, tmp_path):
    """Multi-turn episodes in the real loop: the environment scores them (here with the custom reward, so
    samples differ), the env/* metrics are logged and the rollout dump holds each episode's details."""
    out = tmp_path / "env"
    _run(_args(tiny_qwen2, tmp_path, out, "env.name=retrieval_qa", "env.retriever=bm25", "env.initial_search=true",
               "env.max_turns=2", "env.max_doc_chars=80", "env.top_k=1", "trainer.steps=2",
               "rollout.max_model_len=1024", "env.system_prompt='Search, then answer in <answer></answer>.'",
               "trainer.micro_batch_tokens=2048", "data.max_prompt_length=512", "data.system_prompt=''",
               "data.sources=[{kind: synthetic_multihop, size: 8, seed: 1, options: {distractors: 2}}]",
               "data.val_sources=[{kind: synthetic_multihop, size: 2, seed: 2, options: {distractors: 2}}]",
               "trainer.loggers=[console,tensorboard,wandb,mlflow]"))
    m = _metrics(out)
    check_golden("grpo_env", m)
    # every logger of a real run: tensorboard events, an offline wandb run folder, an MLflow run
    assert list((out / "tensorboard").glob("events.*")) and list((out / "wandb").glob("offline-run-*"))
    assert (out / "mlflow_run_id").is_file() and list((out / "mlruns").glob("*/*/metrics/reward"))
    assert m[1]["env/turns"] >= 1 and m[1]["env/searches"] >= 1  # the opening search counts
    assert m[2]["actor/grad_norm"] > 0 and "val/accuracy" in m[2]
    rows = [json.loads(x) for x in (out / "rollouts" / "step_00000001.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["env"]["end"] in ("done", "turn_limit", "context_limit") for r in rows)
    assert all(r["env"]["retrieved_ids"] for r in rows)


def _hf_greedy(model_dir: Path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
                for ids in prompt_ids]


def test_lora_ppo_syncs_merged_weights_into_vllm_exports_and_resumes(tiny_qwen2, tmp_path):
    """LoRA on the actor and on PPO's critic trunk, with the KL loss against the reference (the actor with
    its adapters off): the run trains, vLLM serves the merged weights after each sync, the run resumes from
    its LoRA checkpoints (actor and critic), and the final checkpoint exports merged (transformers then
    generates what vLLM generated) and as a PEFT adapter. The console stays quiet."""
    out = tmp_path / "lora"
    extra = ["--use-lora", "lora.rank=4", "optim.lr=3e-2", "trainer.save_every=1", "algorithm.name=ppo",
             "optim.critic_lr=1e-3", "algorithm.kl_coef=0.01"]
    _run(_args(tiny_qwen2, tmp_path, out, *extra, "trainer.steps=2"))
    proc = _run(_args(tiny_qwen2, tmp_path, out, *extra, "trainer.steps=3"))
    assert "resuming from" in proc.stderr and "step_00000002" in proc.stderr
    # quiet by default: the stack's expected warnings (megatron-core's Apex fallback, vLLM's after each sync)
    # are in the worker's log, not on the console, which shows the worker's own lines
    console, worker_log = proc.stdout + proc.stderr, (out / "logs" / "policy_rank0.log").read_text()
    for expected in ("Apex is not installed", "Failed to load weights"):
        assert expected in worker_log and expected not in console, expected
    assert "(policy rank 0) " in console and "training" in console and (out / "logs" / "driver.log").is_file()
    m = _metrics(out)
    assert sorted(m) == [1, 2, 3] and all(m[s]["actor/grad_norm"] > 0 and m[s]["critic/grad_norm"] > 0
                                          for s in (1, 2, 3))
    # the reference is the actor with its adapters off: equal to the policy before the first update (B = 0)
    assert abs(m[1]["actor/kl"]) < 1e-6 and m[2]["actor/kl"] > 1e-4
    # steps 2 and 3 sampled from vLLM after the merged sync of the step before (step 3: of the resumed
    # run's restored adapters): the LoRA actor scores those tokens alike
    assert all(m[s]["rollout/token_mult_prob_error"] < 1.001 for s in (2, 3))
    for role in ("actor", "critic"):
        meta = json.loads((out / "checkpoints" / "step_00000003" / role / "megareason.json").read_text())
        assert meta["lora"]["rank"] == 4
    ckpt = out / "checkpoints" / "step_00000003" / "actor"
    merged, peft = tmp_path / "merged", tmp_path / "peft"
    for args in ([str(ckpt), str(merged)], [str(ckpt), str(peft), "--peft"]):
        _run([sys.executable, "-m", "megareason.cli", "convert", "megatron-to-hf", *args], timeout=300)
    assert (peft / "adapter_config.json").is_file() and (peft / "adapter_model.safetensors").is_file()
    # the final validation ran greedy in vLLM after the last sync; transformers on the merged export agrees
    rows = [json.loads(line) for line in (out / "rollouts" / "val_step_00000003.jsonl").read_text().splitlines()]
    prompts = [r["prompt_token_ids"] for r in rows]
    vllm_greedy = [r["response_token_ids"] for r in rows]
    assert _hf_greedy(merged, prompts, 24) == vllm_greedy
    assert _hf_greedy(tiny_qwen2, prompts, 24) != vllm_greedy  # the adapters matter


def _assert_stopped_within_the_bound(at: str, fired: str, stderr: str) -> None:
    """The bound ``megareason plan`` prints for a SIGTERM (the longest piece that cannot stop, then the
    checkpoint), counted in pieces rather than seconds: after the signal the run finished at most the piece in
    progress. ``fired``: where the hook sent the SIGTERM (``tests/hooks/sigterm_at.py``); the driver's last line
    says where the stop took effect and how long after the signal the run exited, its checkpoint committed.

    - between pieces of a log-prob or training pass: the pass gave up before the next piece (on every rank);
    - between engine steps: the engine's ranks gave up at their next agreement, fewer than
      ``STOP_AGREE_STEPS`` engine steps later;
    - during a save or a sync (pieces that cannot stop): they completed and the generation after them gave up
      at its first engine step."""
    from megareason.rollout.colocated import STOP_AGREE_STEPS

    where = [w.split(" ", 1)[1] for w in fired.splitlines() if w.split(" ", 1)[0] == at][-1]
    last = [line for line in stderr.splitlines() if "run again to resume" in line][-1]
    assert re.search(r"; \d+\.\d s after the signal; run again to resume", last), (at, last)
    if where.startswith("piece "):  # the same piece on every rank, whichever rank's stop the driver reports
        assert f"pass stopped before {where} (" in last, (at, where, last)
        return
    gave_up = re.search(r"stopped after (\d+) engine steps: the run is stopping", last)
    assert gave_up is not None, (at, last)
    if where.startswith("engine step "):
        fired = int(where.split()[-1])
        assert fired <= int(gave_up.group(1)) < fired + STOP_AGREE_STEPS, (at, where, last)
    else:
        assert where in ("save", "sync") and gave_up.group(0).startswith("stopped after 0 engine steps"), (at, where)


@pytest.mark.timeout(1800)
def test_colocated_tp2_engine_takes_the_sync_and_a_sigterm_in_each_phase_resumes_to_the_uninterrupted_run(
        tiny_qwen2, tmp_path):
    """rollout.tensor_parallel_size=2 on a trainer of 2 data-parallel ranks: one SPMD vLLM engine whose TP
    ranks live inside the two Ray workers (``rollout.colocated``), each rank loading the synced weights
    in-process; 2 optimizer steps a step (mini-batches), a checkpoint every step. The run trains with GSPO
    (its paper's clip range and sequence-level aggregation), sequence-level MIS, DAPO's dynamic sampling and
    overlong shaping, whose metrics it logs.

    One run folder stopped by a SIGTERM to the driver in each phase, fired at that point by
    ``tests/hooks/sigterm_at.py`` on the policy's rank 0, and resumed each time:

    - during step 2's checkpoint write: the save completes, step 3's generation gives the step up;
    - between two engine steps of step 3's generation (the SPMD engine's two ranks agree on the step);
    - between pieces of step 3's log-prob pass, and of its first optimizer step (the step is dropped);
    - during step 3's weight sync: it completes, and the last step's validation gives up at its first engine
      step (the step is saved, its validation pending);
    - between two engine steps of that pending validation, the next run's first generate (nothing to save).

    Each stopped run exits with EXIT_STOPPED (a Slurm job requeues on it), its latest checkpoint is the one
    the stop promises, and it ran at most the piece in progress after the signal (the bound ``megareason plan``
    prints, in pieces: ``_assert_stopped_within_the_bound``); the last run validates step 3 first and ends.
    The runs together give the uninterrupted run's metrics, every one of every step (golden "stop_tp2"). That
    validation ran greedy in the engine after the resume's sync, and transformers on the exported checkpoint
    agrees."""
    from golden_curves import check_golden, recording

    from megareason.trainer.driver import EXIT_STOPPED
    from megareason.trainer.run_dir import RunDir

    extra = ("parallel.data_parallel_size=2", "rollout.tensor_parallel_size=2", "algorithm.mini_batches=2",
             "trainer.steps=3", "trainer.save_every=1", "trainer.keep_last=1", "optim.lr=1e-2",
             # a rank's share of a mini-batch (4 samples of a prompt: ~70 + 4 x 24 tokens) in 2 micro-batches
             "data.max_prompt_length=100", "rollout.max_model_len=128", "trainer.micro_batch_tokens=128",
             "algorithm.policy_loss=gspo", "algorithm.clip_ratio_low=0.0003", "algorithm.clip_ratio_high=0.0004",
             "algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.rollout_mis_cap=2.0",
             "algorithm.dynamic_sampling=true", "algorithm.overlong_buffer=8")
    if recording():  # the uninterrupted run, for tools/regen_golden.sh
        straight = tmp_path / "straight"
        _run(_args(tiny_qwen2, tmp_path, straight, *extra), timeout=900)
        check_golden("stop_tp2", _metrics(straight))

    out = tmp_path / "stopped"
    hook = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent / "hooks"),
                                                        os.environ.get("PYTHONPATH")])),
            "MEGAREASON_TEST_SIGTERM_RUN": str(out)}
    # (where the SIGTERM fires: phase and which pass of the run, the latest checkpoint after, the log's line)
    dropped = "SIGTERM during step 3's {}: the step was dropped, the run resumes at step 3"
    plan = [("save:2", 2, dropped.format("generation")),
            ("generation:1", 2, dropped.format("generation")),
            ("logprobs:1", 2, dropped.format("log-probs or first optimizer step")),
            ("train:1", 2, dropped.format("log-probs or first optimizer step")),
            # the resume's sync, then step 3's: it completes, and step 3's validation gives up
            ("sync:2", 3, "SIGTERM during step 3's validation: saved; the next run validates it first"),
            # the next run's first validation (step 3's, pending in its checkpoint), between two engine steps
            ("validation:1", 3, "SIGTERM during step 3's validation: stopped; the next run validates it first")]
    for at, latest, line in plan:
        proc = subprocess.run(_args(tiny_qwen2, tmp_path, out, *extra), capture_output=True, text=True, timeout=900,
                              env={**_env(), **hook, "MEGAREASON_TEST_SIGTERM_AT": at})
        assert proc.returncode == EXIT_STOPPED, (at, proc.stdout[-3000:] + proc.stderr[-5000:])
        assert line in proc.stderr, (at, proc.stderr[-5000:])
        assert RunDir(out).steps() == [latest], at
        _assert_stopped_within_the_bound(at, (tmp_path / "stopped.fired").read_text(), proc.stderr)
    _run(_args(tiny_qwen2, tmp_path, out, *extra), timeout=900)
    m = _metrics(out)
    check_golden("stop_tp2", m, record=False)  # the stopped runs together: the uninterrupted run's curve

    assert sorted(m) == [1, 2, 3] and m[1]["actor/grad_norm"] > 0
    for key in ("actor/is_masked", "dapo/tries", "dapo/informative_groups", "dapo/overlong_penalty"):
        assert all(key in m[s] for s in (1, 2, 3)), key
    assert all(m[s]["actor/is_masked"] == 0 for s in (1, 2, 3))  # fp32 against fp32: nothing dropped
    assert m[2]["rollout/token_mult_prob_error"] < 1.001 and m[2]["rollout/max_abs_logp_diff"] < 1e-3
    export = tmp_path / "export"
    _run([sys.executable, "-m", "megareason.cli", "convert", "megatron-to-hf",
          str(out / "checkpoints" / "step_00000003" / "actor"), str(export)], timeout=300)
    # one engine (not one per data-parallel replica) took the whole model: the export's tensor bytes
    with open(export / "model.safetensors", "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    assert m[1]["sync/bytes"] == (export / "model.safetensors").stat().st_size - header
    # the last run's validation, greedy in the engine after the resume's sync: transformers agrees
    rows = [json.loads(line) for line in (out / "rollouts" / "val_step_00000003.jsonl").read_text().splitlines()]
    prompts = [r["prompt_token_ids"] for r in rows]
    vllm_greedy = [r["response_token_ids"] for r in rows]
    assert _hf_greedy(export, prompts, 24) == vllm_greedy
    assert _hf_greedy(tiny_qwen2, prompts, 24) != vllm_greedy  # the sync changed what vLLM generates
