"""TinyV against a scripted OpenAI-compatible stub (no vLLM): parsing, modes by hand, retries, order,
fallbacks, routing of ``<source>_tinyv`` through the registry and ``runner.score``, the config, and the
verifier server's start/wait/stop logic on a stand-in command."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megareason.cli import main
from megareason.config import Config, ConfigError, from_dict, load_config
from megareason.config.schema import TinyVConfig
from megareason.data import DataError, PromptRecord, TokenizedPrompt
from megareason.ports import unused_server_port
from megareason.rewards import get_reward_fn, register
from megareason.rewards.pool import ScoreOutcome, ScorePool, ScoreRequest
from megareason.rewards.registry import base_source
from megareason.rewards.scoring import score, scorer_from
from megareason.rewards.tinyv import (
    CHOICES,
    FALLBACK_ERROR,
    RRM_PROMPT,
    TIMEOUT_ERROR,
    VerifierClient,
    VerifyItem,
    apply_tinyv,
    final_answer,
    parse_rrm_score,
    parse_verdict,
    tinyv_scores,
)
from megareason.rewards.verifier_server import VerifierServer, VerifierServerError, group_alive, serve_verifier
from megareason.rollout.records import Completion

Out = ScoreOutcome


class FakeVerifier:
    """OpenAI-compatible stub on 127.0.0.1. The reply to a chat request is scripted by the model answer
    (TinyV) or the solution (RRM) in its prompt: ``script[answer]`` is a list of actions used one per
    request (the last repeats): a reply text, an HTTP status to fail with, or ``(seconds, text)`` to reply
    after a pause. Unscripted answers get "False"."""

    def __init__(self, script: dict | None = None):
        self.script = script or {}
        self.hits: Counter[str] = Counter()
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, {"data": [{"id": "fake-verifier", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = re.search(r"<(model_answer|solution)>\n(.*?)\n</\1>", body["messages"][0]["content"],
                                   re.DOTALL).group(2)
                with fake.lock:
                    fake.bodies.append(body)
                    actions = fake.script.get(answer, ["False"])
                    action = actions[min(fake.hits[answer], len(actions) - 1)]
                    fake.hits[answer] += 1
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if isinstance(action, int):
                        return self._send(action, {"error": "scripted failure"})
                    if isinstance(action, tuple):
                        time.sleep(action[0])
                        action = action[1]
                    self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": action}}]})
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client timed out and hung up
                    pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False

        self.server = Server(("127.0.0.1", 0), Handler)  # port 0: a free one
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeVerifier()
    yield server
    server.close()


def _cfg(url: str, **kw) -> TinyVConfig:
    return TinyVConfig(**{"base_url": url, "timeout_s": 5.0, "backoff_s": 0.01} | kw)


def _client(url: str, **kw) -> VerifierClient:
    args = dict(model="", timeout_s=5.0, max_retries=3, backoff_s=0.01, concurrency=4) | kw
    return VerifierClient(url, **args)


# --- pure parts ---------------------------------------------------------------
def test_parse_verdict_takes_the_first_true_or_false_word():
    assert parse_verdict("True") is True
    assert parse_verdict(" false.") is False
    assert parse_verdict("FALSE") is False
    assert parse_verdict("The answer is true, not false") is True
    for reply in ("", "maybe", "Trueish", "untrue", "yes"):
        assert parse_verdict(reply) is None


def test_final_answer_is_the_last_box_else_the_last_line():
    assert final_answer("so \\boxed{1} then \\boxed{\\frac{1}{2}}\nDone.") == "\\frac{1}{2}"
    assert final_answer("work\n\n  The answer is 7.  \n\n") == "The answer is 7."
    assert final_answer("   ") == ""
    assert final_answer("x" * 5000) == "x" * 1000


RULE = [Out(1.0, True), Out(0.0, False), Out(0.2, False), Out(0.0, False, error="TimeoutError: t", timed_out=True)]
VERDICTS = [False, True, False, None]


@pytest.mark.parametrize("mode, scores, correct", [
    ("tinyv_only", [0.0, 1.0, 0.0, 0.0], [False, True, False, False]),
    ("addon", [1.0, 0.25, 0.2, 0.0], [True, True, False, False]),  # True on a rule-wrong sample: the weight
    ("mixed", [0.75, 0.25, 0.15, 0.0], [True, True, False, False]),  # 0.75 * rule + 0.25 * verdict
])
def test_tinyv_scores_by_hand(mode, scores, correct):
    out = tinyv_scores(RULE, VERDICTS, mode, weight=0.25)
    assert [o.score for o in out] == pytest.approx(scores)
    assert [o.correct for o in out] == correct
    assert out[3] == RULE[3]  # no verdict: the rule outcome, its error and timeout kept


def test_addon_true_is_worth_the_weight_as_in_the_rrm_recipe():
    # the RRM + TinyV recipe's tinyv.py, addon: rule right -> 1; rule wrong -> verdict * tinyv_weight
    right, wrong = Out(1.0, True), Out(0.0, False)
    out = tinyv_scores([right, wrong, wrong], [None, True, False], "addon", weight=0.5)
    assert [(o.score, o.correct) for o in out] == [(1.0, True), (0.5, True), (0.0, False)]
    assert tinyv_scores([wrong], [True], "addon", weight=1.0)[0].score == 1.0
    # a rule's partial credit (format) is never lowered by a True: max(0.3, 0.25)
    assert tinyv_scores([Out(0.3, False)], [True], "addon", weight=0.25)[0].score == 0.3


def test_tinyv_scores_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="tinyv_only, addon or mixed"):
        tinyv_scores(RULE, VERDICTS, "both", 0.5)


# --- the client against the stub ----------------------------------------------
def test_client_keeps_request_order_under_concurrency_and_sends_a_greedy_short_request(fake):
    # Later items answer sooner, so replies arrive in reverse order.
    fake.script = {f"a{i}": [(0.04 * (8 - i), "True" if i % 2 == 0 else "false.")] for i in range(8)}
    items = [VerifyItem(f"question {i}?", f"ref {i}", f"a{i}") for i in range(8)]
    assert _client(fake.url, concurrency=8).verify_batch(items) == [i % 2 == 0 for i in range(8)]
    assert fake.max_in_flight > 1
    body = fake.bodies[0]
    assert body["model"] == "fake-verifier"  # the first model /v1/models lists
    assert body["temperature"] == 0 and 1 <= body["max_tokens"] <= 16
    assert "structured_outputs" not in body and "guided_choice" not in body
    prompts = {b["messages"][0]["content"] for b in fake.bodies}
    assert any("question 3?" in p and "ref 3" in p for p in prompts)


def test_client_constrains_choices_with_structured_outputs_and_uses_a_given_model(fake):
    client = _client(fake.url, model="tinyv", choices=CHOICES)
    assert client.verify_batch([VerifyItem("q", "1", "x")]) == [False]
    assert fake.bodies[0]["structured_outputs"] == {"choice": ["True", "False"]}
    assert fake.bodies[0]["model"] == "tinyv"
    assert _client(fake.url).verify_batch([]) == []


def test_unparseable_replies_give_no_verdict(fake):
    fake.script = {"g": ["I cannot tell"], "t": ["TRUE"], "e": [""]}
    items = [VerifyItem("q", "1", a) for a in ("g", "t", "e")]
    assert _client(fake.url).verify_batch(items) == [None, True, None]


def test_5xx_and_timeouts_are_retried_4xx_is_not(fake):
    fake.script = {"flaky": [500, 503, "True"], "down": [502], "bad": [400, "True"], "slow": [(1.0, "True")]}
    assert _client(fake.url, max_retries=3).verify_batch([VerifyItem("q", "1", "flaky")]) == [True]
    assert fake.hits["flaky"] == 3
    assert _client(fake.url, max_retries=2).verify_batch([VerifyItem("q", "1", "down")]) == [None]
    assert fake.hits["down"] == 3  # 1 + 2 retries
    assert _client(fake.url).verify_batch([VerifyItem("q", "1", "bad")]) == [None]
    assert fake.hits["bad"] == 1
    assert _client(fake.url, timeout_s=0.2, max_retries=1).verify_batch([VerifyItem("q", "1", "slow")]) == [None]
    assert fake.hits["slow"] == 2


def test_backoff_doubles_between_retries(fake):
    fake.script = {"flaky": [500, 500, 500, "True"]}
    t0 = time.monotonic()
    assert _client(fake.url, backoff_s=0.1, max_retries=3).verify_batch([VerifyItem("q", "1", "flaky")]) == [True]
    assert time.monotonic() - t0 >= 0.1 + 0.2 + 0.4


# --- apply_tinyv: modes, stats, fallbacks ------------------------------------------
REQUESTS = [ScoreRequest("math_tinyv", f"work\n\\boxed{{r{i}}}", "1", {"question": f"Q{i}"}) for i in range(4)]
RULE4 = [Out(1.0, True), Out(0.0, False), Out(0.3, False), Out(0.2, False)]
SCRIPT = {"r0": ["False"], "r1": ["True"], "r2": ["no idea"], "r3": ["False"]}


# r0 right by the rule, verdict False; r1 wrong, True; r2 rule 0.3, no verdict; r3 rule 0.2, False. Weight 0.5.
@pytest.mark.parametrize("mode, fallback, scores, stats", [
    ("addon", "rule", [1.0, 0.5, 0.3, 0.2], {"asked": 3, "upgraded": 1, "fallbacks": 1, "timeouts": 0}),
    # addon, zero: no verdict is a False, which keeps the rule's outcome
    ("addon", "zero", [1.0, 0.5, 0.3, 0.2], {"asked": 3, "upgraded": 1, "fallbacks": 1, "timeouts": 0}),
    ("tinyv_only", "rule", [0.0, 1.0, 0.3, 0.0], {"asked": 4, "upgraded": 1, "fallbacks": 1, "timeouts": 0}),
    ("tinyv_only", "zero", [0.0, 1.0, 0.0, 0.0], {"asked": 4, "upgraded": 1, "fallbacks": 1, "timeouts": 0}),
    ("mixed", "rule", [0.5, 0.5, 0.3, 0.1], {"asked": 4, "upgraded": 1, "fallbacks": 1, "timeouts": 0}),
    # mixed, zero, r2: 0.5 * 0.3 + 0.5 * 0
    ("mixed", "zero", [0.5, 0.5, 0.15, 0.1], {"asked": 4, "upgraded": 1, "fallbacks": 1, "timeouts": 0}),
])
def test_apply_tinyv_modes_by_hand(fake, mode, fallback, scores, stats):
    fake.script = SCRIPT
    outcomes, got = apply_tinyv(REQUESTS, RULE4, _cfg(fake.url, mode=mode, weight=0.5, fallback=fallback))
    assert [o.score for o in outcomes] == pytest.approx(scores)
    assert got == stats
    assert fake.hits["r0"] == (0 if mode == "addon" else 1)  # addon asks only what the rule marked wrong
    assert outcomes[2].error.startswith(FALLBACK_ERROR) and not outcomes[1].error
    assert any("<question>\nQ1\n</question>" in b["messages"][0]["content"] for b in fake.bodies)


def test_the_defaults_are_seed_001s_tinyv_only_and_no_verdict_scores_0(fake):
    fake.script = SCRIPT
    outcomes, stats = apply_tinyv(REQUESTS, RULE4, _cfg(fake.url))  # tinyv_only, weight 1.0, fallback zero
    assert [(o.score, o.correct) for o in outcomes] == [(0.0, False), (1.0, True), (0.0, False), (0.0, False)]
    assert stats == {"asked": 4, "upgraded": 1, "fallbacks": 1, "timeouts": 0}
    assert outcomes[2].error.startswith(FALLBACK_ERROR)  # counted, not silently 0


@pytest.mark.parametrize("fallback, scores", [("rule", [1.0, 0.0, 0.3, 0.2]), ("zero", [0.0, 0.0, 0.0, 0.0])])
def test_nothing_listening_falls_back_and_is_counted(fallback, scores):
    cfg = TinyVConfig(base_url=f"http://127.0.0.1:{unused_server_port()}", mode="tinyv_only", fallback=fallback,
                      max_retries=1, backoff_s=0.01, timeout_s=2.0)
    outcomes, stats = apply_tinyv(REQUESTS, RULE4, cfg)
    assert [o.score for o in outcomes] == scores
    assert stats == {"asked": 4, "upgraded": 0, "fallbacks": 4, "timeouts": 0}
    assert all(o.error.startswith(FALLBACK_ERROR) for o in outcomes)


# --- routing: registry, start-up checks, runner.score ---------------------------
def test_tinyv_names_resolve_to_their_base_rule_reward(monkeypatch):
    import megareason.rewards.registry as registry

    assert base_source("math_tinyv") == "math" and base_source("math") == "math"
    assert get_reward_fn("math_tinyv") is get_reward_fn("math")
    assert get_reward_fn("gsm8k_tinyv") is get_reward_fn("gsm8k")
    with pytest.raises(ValueError, match="unknown data_source 'nope_tinyv'"):
        get_reward_fn("nope_tinyv")
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    with pytest.raises(ValueError, match="must not end in '_tinyv': x_tinyv"):
        register("x", "x_tinyv")(lambda r, g, e: None)
    records = [PromptRecord([{"role": "user", "content": "q"}], src, "1") for src in ("math_tinyv", "nope_tinyv")]
    assert scorer_from(Config().reward, records[:1])("math_tinyv", "\\boxed{1}", "1", {}).correct
    with pytest.raises(DataError, match="nope_tinyv"):
        scorer_from(Config().reward, records)


def _prompt(source: str, question: str, truth: str, **extra) -> TokenizedPrompt:
    return TokenizedPrompt(PromptRecord([{"role": "user", "content": question}], source, truth, extra), "", [])


def _completions(*texts: str) -> list[Completion]:
    return [Completion([1, 2], t, [0.0, 0.0], "stop") for t in texts]


@pytest.mark.parametrize("workers", [0, 1])
def test_runner_sends_only_tinyv_samples_to_the_verifier_in_one_batch(fake, workers):
    fake.script = {"so it is one half": ["True"]}
    prompts = [_prompt("math_tinyv", "What is half of 1?", "0.5", index=0), _prompt("math", "7+1?", "8", index=1)]
    groups = [_completions("\\boxed{0.5}", "so it is one half", "no idea"), _completions("\\boxed{7}")]
    cfg = _cfg(fake.url, mode="addon")
    if workers:
        with ScorePool(workers=workers) as pool:
            samples = score(prompts, groups, pool=pool, tinyv=cfg)
    else:
        samples = score(prompts, groups, tinyv=cfg)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]
    assert [s.correct for s in samples] == [True, True, False, False]
    assert [s.data_source for s in samples] == ["math_tinyv"] * 3 + ["math"]
    assert sum(fake.hits.values()) == 2  # the two wrong math_tinyv samples; never the plain math one
    # No extra_info["question"]: the verifier sees the prompt's last message.
    assert all("<question>\nWhat is half of 1?\n</question>" in b["messages"][0]["content"] for b in fake.bodies)
    assert not samples[1].score_error and not samples[2].score_error  # "False" is a verdict, not a failure


def test_runner_without_tinyv_samples_needs_no_server():
    samples = score([_prompt("math", "q", "8")], [_completions("\\boxed{8}")], tinyv=replace(
        TinyVConfig(), base_url=f"http://127.0.0.1:{unused_server_port()}"))
    assert [s.reward for s in samples] == [1.0] and not samples[0].score_error


# --- config ---------------------------------------------------------------------
def test_tinyv_config_defaults_overrides_and_errors():
    source = {"kind": "reasoning_gym", "name": "basic_arithmetic", "size": 4}
    cfg = from_dict({"data": {"sources": [source]}})
    assert cfg.reward.tinyv == TinyVConfig()
    assert (cfg.reward.tinyv.mode, cfg.reward.tinyv.weight, cfg.reward.tinyv.fallback) == ("tinyv_only", 1.0, "zero")
    cfg = load_config("eval", ["reward.tinyv.mode=mixed", "reward.tinyv.weight=0.3", "reward.tinyv.fallback=zero"])
    assert (cfg.reward.tinyv.mode, cfg.reward.tinyv.weight, cfg.reward.tinyv.fallback) == ("mixed", 0.3, "zero")
    for bad, field in [({"mode": "both"}, "reward.tinyv.mode"), ({"weight": 1.5}, "reward.tinyv.weight"),
                       ({"concurrency": 0}, "reward.tinyv.concurrency"), ({"fallback": "one"}, "reward.tinyv.fallback"),
                       ({"base_url": "127.0.0.1:8000"}, "reward.tinyv.base_url"),
                       ({"verifier": "rubric"}, "reward.tinyv.verifier"),
                       ({"rrm_max_tokens": 0}, "reward.tinyv.rrm_max_tokens"),
                       ({"verifier": "rrm", "constrain_choices": True}, "reward.tinyv.constrain_choices"),
                       ({"rrm_template": "{criteria} only"}, "reward.tinyv.rrm_template"),
                       ({"rrm_template": "{criteria} {solution} \\boxed{x}"}, "reward.tinyv.rrm_template")]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            from_dict({"data": {"sources": [source]}, "reward": {"tinyv": bad}})


# --- RRM: a rubric reward model as the verifier ----------------------------------------
RUBRIC = "1. (6 points) The sum 3 + 4 is computed as 7.\n2. (4 points) The answer is boxed."
SOLUTIONS = ["First, 3 + 4 = 7.\nSo the answer is \\boxed{7}.", "3 + 4 is 8.\n\\boxed{8}",
             "It is seven.\n\\boxed{seven}"]
RRM_REQUESTS = [ScoreRequest("math_tinyv", s, "7", {"question": "What is 3 + 4?", "criteria": RUBRIC},
                             sample_id=f"0/{i}") for i, s in enumerate(SOLUTIONS)]
RRM_RULE = [Out(1.0, True), Out(0.0, False), Out(0.3, False)]  # right, wrong, wrong with partial credit
GRADED = "The sum is right and boxed, but the working is thin.\nTotal Score: 8/10"


def _rrm_cfg(url: str, **kw) -> TinyVConfig:
    return _cfg(url, verifier="rrm", **kw)


def test_rrm_score_is_the_grade_rewards_reading_of_total_score():
    assert parse_rrm_score(GRADED) == 0.8
    assert parse_rrm_score("**Total Score:** **7.5**") == 0.75
    assert parse_rrm_score("Total Score: 12/10") == 1.0  # min(10, X) / 10
    assert parse_rrm_score("Total Score: -3") == 0.0
    assert parse_rrm_score("The total score is 6 out of 10.") == 0.6
    assert parse_rrm_score("A fine answer.") is None
    # The same parser as the `grade` source: against target 1 its reward is (1 - |v - 1|)^2 = v^2.
    for reply in (GRADED, "**Total Score:** **7.5**", "Total Score: 12/10", "The total score is 6 out of 10.",
                  "Total Score 3 points", "A fine answer."):
        v = parse_rrm_score(reply)
        assert get_reward_fn("grade")(reply, "1", {}).score == pytest.approx(0.0 if v is None else v ** 2), reply


def test_rrm_tinyv_only_is_the_grade_and_the_prompt_has_the_rubric_and_the_full_solution(fake):
    fake.script = {s: [GRADED] for s in SOLUTIONS}
    outcomes, stats = apply_tinyv(RRM_REQUESTS, RRM_RULE, _rrm_cfg(fake.url))  # tinyv_only, weight 1.0
    assert [(o.score, o.correct) for o in outcomes] == [(0.8, True)] * 3
    assert stats == {"asked": 3, "upgraded": 2, "fallbacks": 0, "timeouts": 0}
    assert not any(o.error for o in outcomes)
    prompts = sorted(b["messages"][0]["content"] for b in fake.bodies)
    assert prompts == sorted(RRM_PROMPT.format(question="What is 3 + 4?", criteria=RUBRIC, solution=s)
                             for s in SOLUTIONS)
    for p, s in zip(prompts, sorted(SOLUTIONS), strict=True):
        assert RUBRIC in p and f"<solution>\n{s}\n</solution>" in p and "What is 3 + 4?" in p  # all of it
    body = fake.bodies[0]
    assert body["max_tokens"] == 2048 and body["temperature"] == 0 and "structured_outputs" not in body


@pytest.mark.parametrize("mode", ["addon", "mixed"])
def test_rrm_addon_and_mixed_by_hand(fake, mode):
    fake.script = {s: [GRADED] for s in SOLUTIONS}
    v, w = 0.8, 0.6
    outcomes, stats = apply_tinyv(RRM_REQUESTS, RRM_RULE, _rrm_cfg(fake.url, mode=mode, weight=w))
    if mode == "addon":  # the rule's right answer is kept and not asked; a wrong one is worth v * w
        expected = [1.0, max(0.0, v * w), max(0.3, v * w)]  # 1.0, 0.48, 0.48
        assert sum(fake.hits.values()) == 2 and fake.hits[SOLUTIONS[0]] == 0
    else:  # (1 - w) * rule + w * v
        expected = [(1 - w) * 1.0 + w * v, (1 - w) * 0.0 + w * v, (1 - w) * 0.3 + w * v]  # 0.88, 0.48, 0.60
        assert sum(fake.hits.values()) == 3
    assert [o.score for o in outcomes] == pytest.approx(expected)
    assert [o.correct for o in outcomes] == [True, True, True]  # right by the rule, or v >= 0.5
    assert stats["upgraded"] == 2 and stats["fallbacks"] == 0


def test_rrm_addon_at_the_default_weight_pays_the_grade_where_the_rule_says_wrong(fake):
    fake.script = {SOLUTIONS[1]: ["Total Score: 3/10"], SOLUTIONS[2]: [GRADED]}
    outcomes, stats = apply_tinyv(RRM_REQUESTS, RRM_RULE, _rrm_cfg(fake.url, mode="addon"))
    assert [(o.score, o.correct) for o in outcomes] == [(1.0, True), (0.3, False), (0.8, True)]
    assert stats == {"asked": 2, "upgraded": 1, "fallbacks": 0, "timeouts": 0}


def test_rrm_timeout_is_counted_and_scored_as_the_fallback_not_hung(fake):
    fake.script = {SOLUTIONS[0]: [(1.5, GRADED)], SOLUTIONS[1]: [GRADED], SOLUTIONS[2]: ["I like it."]}
    cfg = _rrm_cfg(fake.url, timeout_s=0.3, max_retries=1)
    t0 = time.monotonic()
    outcomes, stats = apply_tinyv(RRM_REQUESTS, RRM_RULE, cfg)
    assert time.monotonic() - t0 < 1.4  # two 0.3 s tries, not the server's 1.5 s pause
    assert fake.hits[SOLUTIONS[0]] == 2
    assert stats == {"asked": 3, "upgraded": 1, "fallbacks": 2, "timeouts": 1}
    assert [(o.score, o.correct) for o in outcomes] == [(0.0, False), (0.8, True), (0.0, False)]  # fallback zero
    assert outcomes[0].error.startswith(TIMEOUT_ERROR) and outcomes[0].error.startswith(FALLBACK_ERROR)
    assert "timed out" in outcomes[0].error
    assert outcomes[2].error.startswith(FALLBACK_ERROR) and not outcomes[2].error.startswith(TIMEOUT_ERROR)
    kept, _ = apply_tinyv(RRM_REQUESTS, RRM_RULE, replace(cfg, fallback="rule"))
    assert (kept[0].score, kept[0].correct) == (1.0, True)  # fallback=rule: the rule outcome


def test_rrm_timeouts_reach_the_step_metrics(fake):
    from megareason.trainer.metrics import _sample_metrics

    fake.script = {"slow\n\\boxed{7}": [(1.5, GRADED)], "fine\n\\boxed{7}": [GRADED]}
    prompts = [_prompt("math_tinyv", "What is 3 + 4?", "7", index=0, criteria=RUBRIC), _prompt("math", "1+1?", "2")]
    groups = [_completions("slow\n\\boxed{7}", "fine\n\\boxed{7}"), _completions("\\boxed{2}")]
    samples = score(prompts, groups, tinyv=_rrm_cfg(fake.url, timeout_s=0.3, max_retries=0))
    assert [s.reward for s in samples] == [0.0, 0.8, 1.0]
    m = _sample_metrics(samples)
    assert (m["reward/verifier_timeouts"], m["reward/verifier_fallbacks"], m["reward/errors"]) == (1, 1, 1)
    assert "reward/verifier_timeouts" not in _sample_metrics(samples[2:])  # no _tinyv sample: no such metric


def test_rrm_template_and_token_budget_are_configurable(fake):
    fake.script = {SOLUTIONS[1]: ["Total Score: 5"]}
    template = "Grade {{this}}.\nRubric: {criteria}\n<solution>\n{solution}\n</solution>"
    cfg = _rrm_cfg(fake.url, rrm_template=template, rrm_max_tokens=512, constrain_choices=True)
    outcomes, _ = apply_tinyv(RRM_REQUESTS[1:2], RRM_RULE[1:2], cfg)
    assert outcomes[0].score == 0.5
    body = fake.bodies[0]
    want = f"Grade {{this}}.\nRubric: {RUBRIC}\n<solution>\n{SOLUTIONS[1]}\n</solution>"  # {{ }}: a brace
    assert body["messages"][0]["content"] == want
    assert body["max_tokens"] == 512 and "structured_outputs" not in body  # choices are TinyV's only


def test_rrm_rows_need_their_rubric_at_start_up():
    rrm = from_dict({"data": {"sources": [{"kind": "reasoning_gym", "name": "basic_arithmetic", "size": 4}]},
                     "reward": {"tinyv": {"verifier": "rrm"}}})
    rows = [PromptRecord([{"role": "user", "content": "q"}], "math_tinyv", "1", {"index": 0, "criteria": RUBRIC}),
            PromptRecord([{"role": "user", "content": "q"}], "math", "1", {"index": 1})]
    scorer_from(rrm.reward, rows)  # a rule-only row needs no rubric
    tinyv_row = PromptRecord([{"role": "user", "content": "q"}], "math_tinyv", "1", {})
    scorer_from(Config().reward, rows + [tinyv_row])  # tinyv
    for criteria in (None, "", 3):
        extra = {"index": 3} | ({} if criteria is None else {"criteria": criteria})
        bad = PromptRecord([{"role": "user", "content": "q"}], "math_tinyv", "1", extra)
        with pytest.raises(DataError, match=r"data row 3 \(data_source 'math_tinyv'\).*extra_info\.criteria.*"
                                            r"non-empty text"):
            scorer_from(rrm.reward, rows + [bad])


def test_rubric_rm_recipe_is_the_run_scripts_main_run():
    from megareason.config import validate_training
    from megareason.data.loaders import load_records

    cfg = load_config("rubric_rm_tinyv", ["data.sources.0.size=3"])
    v, alg = cfg.reward.tinyv, cfg.algorithm
    assert (v.verifier, v.mode, v.weight, v.rrm_max_tokens) == ("rrm", "tinyv_only", 1.0, 2048)
    assert (alg.name, alg.kl_coef, alg.kl_in_reward, alg.kl_reward_kind, alg.kl_loss_kind) == (
        "ppo", 0.0, False, "k1", "low_var_kl")
    validate_training(cfg)
    validate_training(load_config("rubric_rm_tinyv", ["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.001",
                                                      "algorithm.kl_loss_coef=0.001"]))  # the KL-on variant
    records = load_records(cfg.data)
    assert records and all(r.data_source.endswith("_tinyv") and r.extra_info["criteria"] for r in records)
    scorer_from(cfg.reward, records)


# --- verifier server lifecycle, on a stand-in for vLLM -------------------------------
STAND_IN = """
import http.server, subprocess, sys, time
print("loading model", flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine core
open(sys.argv[2], "w").write(str(child.pid))
time.sleep(0.5)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404); self.end_headers(); self.wfile.write(b"{}")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_waits_until_ready_then_stops_its_whole_process_group(tmp_path):
    port = unused_server_port()
    cmd = [sys.executable, "-c", STAND_IN, str(port), str(tmp_path / "child.pid")]
    server = VerifierServer(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log")
    try:
        server.wait_ready(30)
        child = int((tmp_path / "child.pid").read_text())
        assert set(group_alive(server.pid)) == {server.pid, child}
    finally:
        server.stop(grace_s=5)
    assert server.process.returncode is not None
    assert group_alive(server.pid) == []
    assert "loading model" in server.log_tail()


def test_server_start_up_failures_say_why(tmp_path):
    crash = VerifierServer([sys.executable, "-c", "print('boom: no such model'); raise SystemExit(3)"],
                           f"http://127.0.0.1:{unused_server_port()}", tmp_path / "crash.log")
    with pytest.raises(VerifierServerError, match=r"(?s)exited with code 3.*boom: no such model"):
        crash.wait_ready(30)
    crash.stop()
    hang = VerifierServer([sys.executable, "-c", "print('still loading', flush=True); import time; time.sleep(600)"],
                          f"http://127.0.0.1:{unused_server_port()}", tmp_path / "hang.log")
    with pytest.raises(VerifierServerError, match=r"(?s)not ready after 1s; stopped it.*still loading"):
        hang.wait_ready(1.0)
    assert group_alive(hang.pid) == [] and hang.process.returncode is not None


def test_serve_verifier_refuses_a_busy_port_and_an_unknown_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(VerifierServerError, match="already in use"):
            with serve_verifier(str(tmp_path), port=busy.getsockname()[1]):
                pass
    with pytest.raises(FileNotFoundError):
        with serve_verifier(str(tmp_path / "missing")):
            pass
    assert main(["serve-verifier", str(tmp_path / "missing"), "--port", str(unused_server_port())]) == 2


def test_a_rubric_model_served_under_the_default_kind_stops_the_run_naming_the_field(fake):
    """A rubric reward model asked TinyV's question writes grading prose: the first batch stops the run
    with reward.tinyv.verifier named, instead of scoring every sample 0."""
    fake.script = {"7": ["The solution meets the first criterion; score"], "8": ["Grading: criterion 1 is"]}
    requests = [ScoreRequest("math_tinyv", rf"\boxed{{{a}}}", "7", {}, f"s{a}") for a in (7, 8)]
    with pytest.raises(ValueError, match=r"reward.tinyv.verifier=tinyv: none of the first 2 replies.*"
                                         r"a rubric reward model's grading: set reward.tinyv.verifier=rrm"):
        apply_tinyv(requests, [Out(0.0, False)] * 2, _cfg(fake.url))


def test_a_tinyv_model_served_as_a_rubric_model_stops_the_run_and_a_good_first_batch_passes(fake):
    fake.script = {"solution A": ["True"]}
    request = ScoreRequest("math_tinyv", "solution A", "7", {"criteria": "correct answer"}, "s0")
    with pytest.raises(ValueError, match=r"reward.tinyv.verifier=rrm: none of the first 1 replies.*"
                                         r"a TinyV model; set reward.tinyv.verifier=tinyv"):
        apply_tinyv([request], [Out(0.0, False)], _cfg(fake.url, verifier="rrm"))
    # the right kind: one parseable reply in the first batch, later unparseable ones fall back as before
    fake.script, fake.hits = {"solution A": ["Total Score: 8/10", "no grade here"]}, Counter()
    other = _cfg(fake.url.replace("127.0.0.1", "localhost"), verifier="rrm")
    out, stats = apply_tinyv([request], [Out(0.0, False)], other)
    assert out[0].score == pytest.approx(0.8)
    out, stats = apply_tinyv([request], [Out(0.0, False)], other)
    assert stats["fallbacks"] == 1 and out[0].score == 0.0


def test_a_weak_rubric_model_that_grades_nothing_keeps_the_counted_fallback(fake):
    """Ungraded prose from a rubric model is the fallback's business (not refused): counted, scored 0."""
    fake.script = {"solution B": ["I think the steps are fine"]}
    request = ScoreRequest("math_tinyv", "solution B", "7", {"criteria": "correct answer"}, "s0")
    out, stats = apply_tinyv([request], [Out(0.0, False)], _cfg(fake.url, verifier="rrm"))
    assert stats["fallbacks"] == 1 and out[0].score == 0.0 and out[0].error.startswith(FALLBACK_ERROR)
