"""TinyV against a real vLLM OpenAI server (``serve_verifier``) on a tiny random Qwen2 model.

The tiny model's verdicts are arbitrary, so the reply is constrained to "True"/"False" (greedy, hence
deterministic) and the test checks consistency: every verdict is a bool, the same on a second ask,
and each mode's scores and counts follow from the verdicts by the mode's arithmetic; the rubric reward model's
mode grades the full response against the row's rubric on the same server. While it serves, one step of
``megareason train`` on seed 001's pair of sources: ``grade`` rows (what trains a rubric reward model) beside
``_tinyv`` rows that the served model grades against their rubric. Then the server is stopped by its pid (the
whole process group gone) and a stopped server must lead to the fallback.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from megareason.config.schema import TinyVConfig
from megareason.models.tiny import build_tokenizer
from megareason.ports import unused_server_port
from megareason.rewards import compute_score
from megareason.rewards.pool import ScoreRequest, score_one
from megareason.rewards.tinyv import (
    FALLBACK_ERROR,
    PROMPT,
    VerifierClient,
    VerifyItem,
    apply_tinyv,
    final_answer,
    needs_verdict,
    parse_rrm_score,
    tinyv_scores,
    verifier_prompt,
)
from megareason.rewards.verifier_server import group_alive, serve_verifier

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
WEIGHT = 0.25
# (question, response, ground truth): rule-correct, a false negative, wrong, and unboxed.
CASES = [
    ("What is 2 + 2?", "2 + 2 = 4, so \\boxed{4}", "4"),
    ("What is half of 1?", "Half of one is \\boxed{one half}", "0.5"),  # words: the rule's equivalence misses it
    ("What is 3 * 3?", "I think \\boxed{10}", "9"),
    ("Name the capital of France.", "It is Paris", "Paris"),
]


def _train_on_grade_and_rrm_rows(model, tmp_path, server) -> tuple[list[dict], dict]:
    """One GRPO step on `grade` rows and `_tinyv` rows graded by ``server`` as a rubric reward model; the
    step's rollouts and metrics."""
    from test_train_e2e import _args, _metrics, _run

    grade = tmp_path / "grade.jsonl"  # a judge's text to write, scored against the target grade
    grade.write_text("".join(json.dumps({"prompt": f"Grade this answer to {a} + {a}: {2 * a}. End with Total "
                                                   f"Score: X/10.", "solution": "0.8"}) + "\n" for a in range(4)))
    out = tmp_path / "rrm_run"
    args = [a for a in _args(model, tmp_path, out) if not a.startswith("reward.custom=")]
    _run([*args, "trainer.steps=1", "trainer.save_every=0", "trainer.val_every=0", "data.val_sources=[]",
          "trainer.prompts_per_step=6", "data.sources=[{kind: file, path: " + str(grade) + ", data_source: grade}, "
          "{kind: reasoning_gym, name: basic_arithmetic, size: 4, data_source: basic_arithmetic_tinyv, "
          "extra_info: {criteria: 'One point per correct step.'}}]",
          f"reward.tinyv.base_url={server.base_url}", "reward.tinyv.verifier=rrm", "reward.tinyv.mode=tinyv_only",
          "reward.tinyv.rrm_max_tokens=24", "reward.tinyv.timeout_s=60", "reward.tinyv.max_retries=1"])
    rows = [json.loads(x) for x in (out / "rollouts" / "step_00000001.jsonl").read_text().splitlines()]
    return rows, _metrics(out)[1]


def _chat_requests(server) -> int:
    """The chat completions the server answered so far (its access log)."""
    return server.log_path.read_text().count("POST /v1/chat/completions")


def test_tinyv_modes_against_a_real_vllm_server_then_fallback_once_stopped(tiny_qwen2, tmp_path):
    requests = [ScoreRequest("math_tinyv", r, gt, {"question": q}) for q, r, gt in CASES]
    rule = [score_one(compute_score, r) for r in requests]
    assert [o.correct for o in rule] == [True, False, False, False] and not any(o.error for o in rule)
    items = [VerifyItem(q, gt, final_answer(r)) for q, r, gt in CASES]
    tok = build_tokenizer()
    longest = max(len(tok(PROMPT.format(question=i.question, reference=i.reference, answer=i.answer))["input_ids"])
                  for i in items)
    assert longest + 64 < MAX_MODEL_LEN  # room for the chat template and the reply

    with serve_verifier(str(tiny_qwen2), port=unused_server_port(), max_model_len=MAX_MODEL_LEN,
                        start_timeout_s=300) as server:
        cfg = TinyVConfig(base_url=server.base_url, constrain_choices=True, timeout_s=60.0, max_retries=1,
                          backoff_s=0.5, weight=WEIGHT)
        client = VerifierClient.from_config(cfg)
        verdicts = client.verify_batch(items)
        again = client.verify_batch(items)
        results = {mode: apply_tinyv(requests, rule, replace(cfg, mode=mode))
                   for mode in ("tinyv_only", "addon", "mixed")}
        # The rubric reward model's mode on the same server: the full response graded against the row's
        # rubric, a free-text reply read by the `grade` rule ("Total Score: X" -> min(10, X) / 10).
        rubric = [replace(r, extra_info={**r.extra_info, "criteria": "One point per correct step."})
                  for r in requests]
        rrm_cfg = replace(cfg, verifier="rrm", constrain_choices=False, rrm_max_tokens=24, mode="tinyv_only")
        rrm, rrm_stats = apply_tinyv(rubric, rule, rrm_cfg)
        prompts = [verifier_prompt(r, rrm_cfg) for r in rubric]
        grades = VerifierClient.from_config(rrm_cfg).ask_batch(prompts, parse_rrm_score)
        asked_before = _chat_requests(server)
        rows, metrics = _train_on_grade_and_rrm_rows(tiny_qwen2, tmp_path, server)
        asked_by_run = _chat_requests(server) - asked_before
        regraded = VerifierClient.from_config(rrm_cfg).ask_batch(  # rrm_cfg: the run's reward.tinyv settings
            [verifier_prompt(ScoreRequest(r["data_source"], r["response"], r["ground_truth"],
                                          {"question": r["question"], "criteria": "One point per correct step."}),
                             rrm_cfg) for r in rows if r["data_source"] == "basic_arithmetic_tinyv"], parse_rrm_score)
        pid = server.pid
    assert server.process.returncode is not None
    assert group_alive(pid) == []  # the API server and its engine-core process
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    assert all(isinstance(v, bool) for v in verdicts), verdicts
    assert again == verdicts
    for mode, (outcomes, stats) in results.items():
        asked = [needs_verdict(o, mode) for o in rule]
        expected = [v if a else None for v, a in zip(verdicts, asked, strict=True)]
        assert outcomes == tinyv_scores(rule, expected, mode, WEIGHT), mode
        upgraded = sum(v and not o.correct for v, o, a in zip(verdicts, rule, asked, strict=True) if a)
        assert stats == {"asked": sum(asked), "upgraded": upgraded, "fallbacks": 0, "timeouts": 0}, mode
    # Each sample is graded (greedy: the same reply as the second ask) or counted as a fallback scoring 0.
    assert all("One point per correct step." in p and r.response in p for p, r in zip(prompts, rubric, strict=True))
    assert rrm_stats == {"asked": 4, "upgraded": sum(g.value is not None and g.value >= 0.5 and not o.correct
                                                     for g, o in zip(grades, rule, strict=True)),
                         "fallbacks": sum(g.value is None for g in grades), "timeouts": 0}
    assert [o.score for o in rrm] == [0.0 if g.value is None else g.value for g in grades]
    assert all(o.error.startswith(FALLBACK_ERROR) == (g.value is None) for o, g in zip(rrm, grades, strict=True))
    only, addon, mixed = (results[m][0] for m in ("tinyv_only", "addon", "mixed"))
    for v, r, o_only, o_addon, o_mixed in zip(verdicts, rule, only, addon, mixed, strict=True):
        assert o_only.score == float(v) and o_only.correct == v
        assert o_addon.score == (r.score if r.correct or not v else max(r.score, WEIGHT))  # True: worth the weight
        assert o_mixed.score == pytest.approx((1 - WEIGHT) * r.score + WEIGHT * float(v))

    # The training step: the grade rows scored by the `grade` rule, each _tinyv sample sent once to the served
    # rubric reward model (its log counts the requests) and scored by its grade, or counted as a fallback.
    graded = [r for r in rows if r["data_source"] == "basic_arithmetic_tinyv"]
    judged = [r for r in rows if r["data_source"] == "grade"]
    assert len(graded) + len(judged) == 6 * 4 and graded and judged and asked_by_run == len(graded)
    for r in judged:
        assert r["reward"] == compute_score("grade", r["response"], "0.8", {}).score and not r["score_error"]
    # greedy: asked again after the run, the server grades each sample as it did in the run (None: no grade read)
    assert [r["reward"] for r in graded] == [0.0 if g.value is None else g.value for g in regraded]
    assert [r["score_error"].startswith(FALLBACK_ERROR) for r in graded] == [g.value is None for g in regraded]
    assert metrics["reward/verifier_fallbacks"] == sum(g.value is None for g in regraded)
    assert metrics["reward/verifier_timeouts"] == 0

    # The server is gone: every sample asked scores as if the verifier said False (the default fallback,
    # the RRM + TinyV recipe's), or keeps its rule outcome with fallback=rule; counted either way.
    gone = replace(cfg, mode="tinyv_only", timeout_s=5.0, backoff_s=0.1)
    outcomes, stats = apply_tinyv(requests, rule, gone)
    assert stats == {"asked": 4, "upgraded": 0, "fallbacks": 4, "timeouts": 0}
    assert [(o.score, o.correct) for o in outcomes] == [(0.0, False)] * 4
    assert all(o.error.startswith(FALLBACK_ERROR) for o in outcomes)
    outcomes, _ = apply_tinyv(requests, rule, replace(gone, fallback="rule"))
    assert [(o.score, o.correct) for o in outcomes] == [(o.score, o.correct) for o in rule]
