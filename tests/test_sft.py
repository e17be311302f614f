"""`megareason sft`: demonstrations, the NLL loss by hand, and a run whose first validation loss equals
transformers' NLL of the same tokens (an independent reference) and falls with training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from golden_curves import check_golden

from megareason.config import ConfigError
from megareason.data.loaders import DataError
from megareason.data.prompts import demonstration
from megareason.data.records import PromptRecord
from megareason.models.tiny import build_tokenizer
from megareason.trainer.losses import sft_loss_fn
from megareason.trainer.sft import tokenize_demonstrations

TEMPLATE = "{solution}\n\nThe final answer is \\boxed{{{answer}}}."


def test_demonstration_from_chat_and_from_seed_rows():
    chat = PromptRecord(prompt=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                        data_source="math", ground_truth="4")
    assert demonstration(chat, TEMPLATE, "r") == ([{"role": "user", "content": "2+2?"}], "4")
    seed = PromptRecord(prompt=[{"role": "user", "content": "2+2?"}], data_source="math", ground_truth="4",
                        extra_info={"solution": " 2 and 2 make 4. "})
    assert demonstration(seed, TEMPLATE, "r")[1] == "2 and 2 make 4.\n\nThe final answer is \\boxed{4}."
    bare = PromptRecord(prompt=[{"role": "user", "content": "q"}], data_source="countdown", ground_truth="24",
                        extra_info={"expert_answer": "3*8"})
    assert demonstration(bare, "<answer>{answer}</answer>", "r")[1] == "<answer>3*8</answer>"
    assert demonstration(bare, TEMPLATE, "r")[1] == "The final answer is \\boxed{3*8}."
    with pytest.raises(ConfigError, match="sft.response_template .*\\{solution\\} and \\{answer\\}"):
        demonstration(bare, "{reasoning}", "r")
    with pytest.raises(DataError, match="file.jsonl row 3: no answer to imitate"):
        demonstration(PromptRecord(prompt=[{"role": "user", "content": "q"}], data_source="m", ground_truth=" "),
                      TEMPLATE, "file.jsonl row 3")


def test_tokenized_demonstrations_end_with_eos_and_drop_long_ones():
    tok = build_tokenizer()
    recs = [PromptRecord(prompt=[{"role": "user", "content": "q"}], data_source="m", ground_truth="7"),
            PromptRecord(prompt=[{"role": "user", "content": "q " * 300}], data_source="m", ground_truth="7")]
    prompts, responses = tokenize_demonstrations(recs, tok, "{answer}", 64, "data")
    assert len(prompts) == 1
    assert responses[0].token_ids == tok.encode("7", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode(prompts[0].token_ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(DataError, match="no demonstration fits rollout.max_model_len=8"):
        tokenize_demonstrations(recs, tok, "{answer}", 8, "data")


def test_sft_loss_is_the_mean_nll_of_response_tokens():
    # two packed sequences: [prompt, r, r] and [prompt, r]; log-probs -1, -2 | -3 -> token-mean 6 / 3 = 2
    batch = type("B", (), {"cu_seqlens": torch.tensor([0, 3, 5]),
                           "fields": {"mask_BT": torch.tensor([[0.0, 1, 1, 0, 1]])}})()
    logp = torch.tensor([[-9.0, -1, -2, -9, -3]], requires_grad=True)
    num, den, m = sft_loss_fn("token-mean")(logp, torch.zeros_like(logp), batch)
    assert float((num / den).detach()) == pytest.approx(2.0) and float(m["nll_num"]) == 6.0
    assert float(m["tokens"]) == 3
    (num / den).backward()
    assert logp.grad[0].tolist() == pytest.approx([0, -1 / 3, -1 / 3, 0, -1 / 3])
    # seq-mean-token-mean: (1.5 + 3) / 2 = 2.25
    num, den, _ = sft_loss_fn("seq-mean-token-mean")(logp, torch.zeros_like(logp), batch)
    assert float((num / den).detach()) == pytest.approx(2.25)


def _hf_nll(model_dir, prompts, responses) -> float:
    """Mean NLL of the response tokens under transformers (float32), the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            ids = torch.tensor([p + r])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            targets = ids[0, 1:]
            picked = logp[torch.arange(len(targets)), targets][len(p) - 1:]
            total, count = total - float(picked.sum()), count + len(r)
    return total / count


def _sft_args(model: Path, tmp_path: Path, name: str, *extra: str) -> tuple[Path, Path, list[str]]:
    """`megareason sft` on four arithmetic demonstrations (trained and validated on): (data file, run
    folder, command line)."""
    rows = [{"question": f"What is {a} plus {b}?", "answer": str(a + b), "solution": f"{a} + {b} = {a + b}"}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / name
    src = f"[{{kind: file, path: {data}, data_source: arithmetic}}]"
    args = [sys.executable, "-m", "megareason.cli", "sft", f"model.path={model}", f"trainer.output_dir={out}",
            f"data.sources={src}", f"data.val_sources={src}", "trainer.steps=4", "trainer.prompts_per_step=4",
            "trainer.val_every=4", "trainer.save_every=4", "optim.lr=1e-3", "rollout.max_tokens=16",
            "rollout.max_model_len=256", "trainer.micro_batch_tokens=256", "data.max_prompt_length=128",
            "data.system_prompt=''", *extra]
    return data, out, args


@pytest.mark.slow
def test_sft_with_lora_matches_transformers_stops_on_sigterm_and_resumes_to_the_golden_curve(tiny_qwen2, tmp_path):
    """SFT on LoRA adapters under Slurm's pre-emption: SIGTERM during a step -> that step finishes (or its
    validation gives up, and the next run does it first), a checkpoint (the adapters and their optimizer
    state), exit code 75; the rerun resumes from it and the whole curve equals the golden one of a run never
    stopped. Its first loss is transformers' NLL of the same tokens
    (the adapters start as the identity: B = 0), and the adapters lower the validation loss. (Full-parameter
    training: every RL run.)"""
    import os
    import signal
    import time

    data, out, args = _sft_args(tiny_qwen2, tmp_path, "sft", "--use-lora", "lora.rank=8", "optim.lr=2e-2")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    metrics = out / "metrics.jsonl"

    def logged() -> list[int]:
        text = metrics.read_text() if metrics.exists() else ""
        return [json.loads(x)["step"] for x in text[:text.rfind("\n") + 1].splitlines()]

    # Step 0's validation row comes before the loop (a signal then would stop before step 1, with nothing to
    # save). Once step 1 is logged, freeze the run at once (steps 2 and 3 take a fraction of a second
    # here), then signal it: its handler runs as it continues, at the latest in step 2 or 3, which then
    # ends with a checkpoint and exit code 75.
    size, steps = -1, []
    while max(steps, default=-1) < 1:
        now = metrics.stat().st_size if metrics.exists() else -1
        if now != size:
            size, steps = now, logged()
            continue
        assert proc.poll() is None, proc.stderr.read()[-5000:]
        assert time.time() < deadline, "step 1 not logged within 10 minutes"
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    assert max(logged()) < 4, "the run got to its last step before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    stderr = proc.communicate(timeout=600)[1]
    assert proc.returncode == 75, stderr[-5000:]
    # After the step in progress, or during a validation's generation (the step is saved, its row waits for
    # the validation the next run does first): either way the rerun's curve is the golden one.
    assert "SIGTERM: stopped after step" in stderr or "validation: saved; the next run validates it first" in stderr
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0] in ("step_00000001", "step_00000002", "step_00000003"), saved  # not 4

    resumed = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert f"resuming from {out / 'checkpoints' / saved[0]}" in resumed.stderr
    m = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}
    check_golden("sft", m)

    from transformers import AutoTokenizer

    from megareason.data.loaders import load_file

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    prompts, responses = tokenize_demonstrations(load_file(data, "arithmetic"), tok, TEMPLATE, 256, "data")
    reference = _hf_nll(str(tiny_qwen2), [p.token_ids for p in prompts], [r.token_ids for r in responses])
    assert m[0]["val/loss"] == pytest.approx(reference, rel=1e-4)  # before training: the same model, same tokens
    assert m[1]["sft/loss"] == pytest.approx(reference, rel=1e-4)  # step 1 trains on those 4 rows, pre-update
    assert m[4]["val/loss"] < 0.8 * m[0]["val/loss"]
    assert m[4]["sft/loss"] < m[1]["sft/loss"] and "val/accuracy" in m[4]
    meta = json.loads((out / "checkpoints" / "step_00000004" / "actor" / "megareason.json").read_text())
    assert meta["lora"]["rank"] == 8
    assert (out / "plots" / "sft.png").is_file()
