"""RARO: labels, the reward matrix, the joint-loss weights, the replay buffer and the critic pass.

The critic pass runs here with a scripted critic (a function of the prompt it is shown) in place of
vLLM, so every verdict, and so every reward, is known in advance.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from megareason.algorithms.estimate import compute_advantages
from megareason.algorithms.losses import aggregate, ppo_policy_loss
from megareason.algorithms.raro import Verdict, parse_label, reward_matrix, role_advantage_scale, to_role
from megareason.config.schema import AlgorithmConfig, Config, RaroConfig
from megareason.data.records import PromptRecord, TokenizedPrompt
from megareason.raro.critic import critic_round
from megareason.raro.prompts import CRITIC_SYSTEM_PROMPT, critic_messages, policy_answer, render
from megareason.raro.replay import ReplayBuffer, Triplet
from megareason.rollout.records import Completion, Sampling
from megareason.trainer.experience import build_experience

# --- labels and the reward matrix -------------------------------------------------------------------


@pytest.mark.parametrize("text, label", [
    ("The first answer checks out.\nVerdict: A", "A"),
    ("**Verdict:** B", "B"),
    ("verdict - (B)", "B"),
    ("I cannot tell.\nVerdict: Tie", "tie"),
    ("VERDICT: TIE", "tie"),
    ("so the answer is \\boxed{A}", "A"),
    ("Verdict: A\n(repeating) Verdict: A", "A"),
    # the final verdict line decides (as in RARO's verl implementation): the format quoted first, then the
    # critic's own verdict
    ("I must end with 'Verdict: A', 'Verdict: B' or 'Verdict: Tie'.\nB is sloppier.\nVerdict: A", "A"),
    ("Verdict: A ... on reflection, no.\nVerdict: B", "B"),
    ("Verdict: B\nBecause the first answer repeats the question.", "B"),
])
def test_parse_label_valid(text, label):
    assert parse_label(text) == label


@pytest.mark.parametrize("text", [
    "",
    "A is the expert's answer",  # no 'Verdict:' line
    "verdict: a tie",  # lower-case article, not the label A
    "Verdict: C",
    "Verdict: A ... on reflection, Verdict: B",  # ambiguous
    "Verdict: Tie \\boxed{A}",  # ambiguous across forms
])
def test_parse_label_invalid_or_ambiguous(text):
    assert parse_label(text) is None


@pytest.mark.parametrize("expert_first", [True, False])
def test_reward_matrix_every_label_with_and_without_shuffling(expert_first):
    # Expert shown as A (expert_first) or as B (shuffled): the label naming the expert's position
    # pays the critic 1 and the policy 0, the other position the reverse, Tie the taus.
    expert_label, policy_label = ("A", "B") if expert_first else ("B", "A")
    taus = {"tau_pol": 0.6, "tau_crit": 0.55}
    assert to_role(expert_label, expert_first) is Verdict.EXPERT
    assert to_role(policy_label, expert_first) is Verdict.POLICY
    assert reward_matrix(to_role(expert_label, expert_first), **taus) == (0.0, 1.0)
    assert reward_matrix(to_role(policy_label, expert_first), **taus) == (1.0, 0.0)
    assert reward_matrix(to_role("tie", expert_first), **taus) == (0.6, 0.55)
    assert reward_matrix(to_role(None, expert_first), **taus) is None


def test_policy_answer_extraction():
    assert policy_answer("<think>try 3*4</think> <answer> 3*4+1 </answer>") == "3*4+1"
    assert policy_answer("<think>hmm</think>\n12") == "12"
    assert policy_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert policy_answer("<think>unfinished") == "<think>unfinished"
    assert policy_answer("<think>x</think>") == "(empty answer)"


# --- joint loss weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_role_weights_give_lambda_weighted_role_losses(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 7, 9
    mask_BT = (torch.rand(B, T, generator=g) > 0.3).float()
    mask_BT[2] = 0  # a row without scored tokens
    is_critic_B = torch.tensor([False, True, False, True, True, False, True])
    adv_B = torch.randn(B, generator=g)
    logp_BT = torch.randn(B, T, generator=g, requires_grad=True)
    old_BT = logp_BT.detach() + 0.3 * torch.randn(B, T, generator=g)

    def J(rows, adv_BT):
        num, den, _ = ppo_policy_loss(logp_BT[rows], old_BT[rows], adv_BT[rows], mask_BT[rows], mode=mode)
        return num / den

    w_B = role_advantage_scale(is_critic_B, mask_BT, mode, lambda_pol=1 / 9, lambda_crit=8 / 9)
    joint = J(slice(None), (adv_B * w_B)[:, None].expand(B, T))
    plain = adv_B[:, None].expand(B, T)
    separate = J(~is_critic_B, plain) / 9 + J(is_critic_B, plain) * 8 / 9
    torch.testing.assert_close(joint, separate, rtol=1e-5, atol=1e-7)
    grad_joint, = torch.autograd.grad(joint, logp_BT)
    grad_sep, = torch.autograd.grad(separate, logp_BT)
    torch.testing.assert_close(grad_joint, grad_sep, rtol=1e-5, atol=1e-7)


def test_role_weights_without_critic_rows():
    mask_BT = torch.ones(3, 4)
    w_B = role_advantage_scale(torch.zeros(3, dtype=torch.bool), mask_BT, "token-mean", lambda_pol=0.5,
                               lambda_crit=0.5)
    torch.testing.assert_close(w_B, torch.full((3,), 0.5))  # J = 0.5 * J_pol: weight lambda_pol
    num, den = aggregate(torch.ones(3, 4) * w_B[:, None], mask_BT, "token-mean")
    assert float(num / den) == pytest.approx(0.5)


# --- replay buffer ------------------------------------------------------------------------------------


def _t(i: int) -> Triplet:
    return Triplet(question=f"q{i}", expert="e", policy=f"p{i}", index=i)


def test_fifo_keeps_the_last_items_in_order():
    buf = ReplayBuffer(3, "fifo")
    buf.add([_t(i) for i in range(5)])
    assert [t.index for t in buf.items] == [2, 3, 4]
    assert buf.seen == 5


def test_reservoir_is_uniform_over_the_stream():
    # Each of 100 streamed items should be kept with probability 10/100. Over 2,000 independent
    # buffers the inclusion counts are checked with a chi-square test (99 degrees of freedom; 148.2
    # is the 0.999 quantile, so a correct sampler fails 1 run in 1,000; this seed set passes).
    runs, stream, capacity = 2000, 100, 10
    counts = [0] * stream
    for seed in range(runs):
        buf = ReplayBuffer(capacity, "reservoir", seed=seed)
        buf.add([_t(i) for i in range(stream)])
        for t in buf.items:
            counts[t.index] += 1
    expected = runs * capacity / stream
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 148.2, f"chi-square {chi2:.1f}: inclusion counts {counts}"
    # And a FIFO buffer is maximally non-uniform on the same test (sanity of the statistic).
    fifo = [0] * stream
    for i in range(stream - capacity, stream):
        fifo[i] = runs
    assert sum((c - expected) ** 2 / expected for c in fifo) > 1000


@pytest.mark.parametrize("kind", ["fifo", "reservoir"])
def test_buffer_state_survives_a_checkpoint_round_trip(kind):
    buf = ReplayBuffer(5, kind, seed=3)
    buf.add([_t(i) for i in range(12)])
    restored = ReplayBuffer.from_state(json.loads(json.dumps(buf.state_dict())))
    assert restored.items == buf.items and restored.seen == buf.seen
    for b in (buf, restored):  # and it goes on exactly as the original would
        b.add([_t(i) for i in range(12, 40)])
    assert restored.items == buf.items
    assert restored.sample(3, seed=7) == buf.sample(3, seed=7)


def test_buffer_rejects_bad_settings():
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)
    with pytest.raises(ValueError, match="kind"):
        ReplayBuffer(3, "lifo")


# --- the critic pass, with a scripted critic ------------------------------------------------------------


class _Tokenizer:
    """Characters as tokens; the chat template joins the messages."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 for c in text]}


def _completion(text: str, finish: str = "stop") -> Completion:
    ids = [ord(c) % 50 for c in text] or [1]
    return Completion(token_ids=ids, text=text, logprobs_T=[-0.5] * len(ids), finish_reason=finish)


def _policy_batch(n_prompts: int, n: int):
    prompts, groups = [], []
    for i in range(n_prompts):
        rec = PromptRecord(prompt=[{"role": "user", "content": f"question {i}"}], data_source="countdown",
                           ground_truth=str(10 + i), extra_info={"index": i, "question": f"question {i}",
                                                                  "expert_answer": f"E{i}"})
        prompts.append(TokenizedPrompt(record=rec, text=f"question {i}", token_ids=[1, 2, 3]))
        groups.append([_completion(f"<answer>P{i}.{j}</answer>") for j in range(n)])
    return prompts, groups


def _scripted_critic(decide):
    """A critic whose j-th judgement of a prompt is ``decide(record, j)``; records every prompt."""
    seen = []

    def generate(prompts, sampling: Sampling):
        seen.append((prompts, sampling))
        return [[_completion(decide(p.record, j)) for j in range(sampling.n)] for p in prompts]

    return generate, seen


def _round(cfg: RaroConfig, prompts, groups, buffer, generate, step=1):
    return critic_round(cfg, step, 0, prompts, groups, buffer, _Tokenizer(), generate,
                        Sampling(n=4, temperature=1.0, max_tokens=8, seed=100, stop=("</answer>",)),
                        max_prompt_tokens=10_000)


def _expert_position(rec) -> str:
    return rec.ground_truth  # "A" or "B": where the expert's answer was shown


@pytest.mark.parametrize("shuffle", [True, False])
def test_perfect_critic_pays_the_critic_and_not_the_policy(shuffle):
    prompts, groups = _policy_batch(3, 2)
    generate, seen = _scripted_critic(lambda rec, j: f"Verdict: {_expert_position(rec)}")
    cfg = RaroConfig(critic_n=2, shuffle_answers=shuffle, replay_buffer_ratio=0.0)
    rb = _round(cfg, prompts, groups, ReplayBuffer(10), generate)
    (critic_prompts, _), = seen
    positions = [p.record.ground_truth for p in critic_prompts]
    assert set(positions) == ({"A", "B"} if shuffle else {"A"})
    for p in critic_prompts:  # the expert's answer is where the record says it is
        user = p.record.prompt[-1]["content"]
        expert_text = user.split(f"Answer {p.record.ground_truth}:\n")[1].split("\n")[0]
        assert expert_text.startswith("E")
    assert rb.reward_B[:6].tolist() == [0.0] * 6 and rb.reward_B[6:].tolist() == [1.0] * 12
    assert rb.keep_B.all()
    assert rb.metrics["raro/critic_accuracy"] == 1.0 and rb.metrics["raro/policy_fool_rate"] == 0.0


def test_fooled_and_tied_critic_rewards_per_triplet():
    prompts, groups = _policy_batch(2, 2)
    # Triplet of prompt 0: always fooled (names the policy's position); prompt 1: Tie, then fooled.
    def decide(rec, j):
        fooled = "B" if rec.ground_truth == "A" else "A"
        return f"Verdict: {fooled}" if rec.extra_info["index"] == 0 or j == 1 else "Verdict: Tie"

    generate, _ = _scripted_critic(decide)
    rb = _round(RaroConfig(critic_n=2, replay_buffer_ratio=0.0, tau_pol=0.6, tau_crit=0.55), prompts, groups,
                ReplayBuffer(10), generate)
    assert rb.reward_B[:4].tolist() == pytest.approx([1.0, 1.0, 0.8, 0.8])  # mean of (0.6, 1.0)
    assert rb.reward_B[4:].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.55, 0.0, 0.55, 0.0])
    assert rb.metrics["raro/tie_rate"] == pytest.approx(2 / 8)
    assert rb.metrics["raro/policy_fool_rate"] == pytest.approx(6 / 8)
    assert rb.metrics["raro/critic_accuracy"] == 0.0


def test_unparseable_judgements_and_long_responses_are_masked_out_of_the_update():
    prompts, groups = _policy_batch(2, 2)
    groups[1][1] = _completion("<answer>cut off", finish="length")  # over the length limit: filtered
    # Prompt 0, sample 0: both judgements unparseable -> that policy row has no reward either.
    def decide(rec, j):
        if "P0.0" in rec.prompt[-1]["content"]:
            return "I think it is the first one"
        return f"Verdict: {_expert_position(rec)}" if j == 0 else "Verdict: maybe"

    generate, _ = _scripted_critic(decide)
    rb = _round(RaroConfig(critic_n=2, replay_buffer_ratio=0.0), prompts, groups, ReplayBuffer(10), generate)
    # Policy rows: P0.0 (no parseable judgement), P0.1, P1.0 kept, P1.1 filtered (never judged).
    assert rb.keep_B[:4].tolist() == [False, True, True, False]
    assert len(rb.prompts) == 2 + 3  # three triplets judged
    assert rb.keep_B[4:].tolist() == [False, False, True, False, True, False]
    assert rb.metrics["raro/format_error_rate"] == pytest.approx(4 / 6)
    assert rb.metrics["raro/policy_filtered_rate"] == pytest.approx(1 / 4)

    # The update's batch holds the kept rows only, so the masked ones contribute no gradient: the
    # loss over it equals the loss with the masked samples deleted from the input altogether.
    keep = rb.keep_B.nonzero().flatten().tolist()
    exp = build_experience(rb.prompts, rb.groups).select(keep)
    assert len(exp) == 4
    response_texts = [c.text for g in rb.groups for c in g]
    kept_texts = {response_texts[k] for k in keep}
    assert "<answer>cut off" not in kept_texts and "I think it is the first one" not in kept_texts
    cfg = Config(algorithm=AlgorithmConfig(name="raro"))
    adv = compute_advantages(cfg.algorithm, cfg.raro, exp, rb.reward_B[keep], rb.group_B[keep],
                             rb.is_critic_B[keep])["adv_BT"]
    assert torch.isfinite(adv).all()
    # Every group kept a single row here (no baseline): advantages exactly 0.
    assert adv.abs().sum() == 0


@pytest.mark.parametrize("truncated", ["drop", "judge", "lose"])
def test_a_cut_response_is_dropped_judged_or_paid_as_a_loss(truncated):
    """raro.truncated: prompt 1's second answer was cut at max_tokens. drop: never judged, no gradient;
    judge: judged like the others (the critic is fooled by every answer here: policy reward 1); lose:
    policy reward 0 (the expert's win) without a judgement, kept in the update."""
    prompts, groups = _policy_batch(2, 2)
    groups[1][1] = _completion("<answer>cut off", finish="length")
    generate, seen = _scripted_critic(lambda rec, j: f"Verdict: {'B' if rec.ground_truth == 'A' else 'A'}")
    rb = _round(RaroConfig(critic_n=2, replay_buffer_ratio=0.0, truncated=truncated), prompts, groups,
                ReplayBuffer(10), generate)
    (critic_prompts, _), = seen
    judged = ["cut off" in p.record.prompt[-1]["content"] for p in critic_prompts]
    assert judged.count(True) == (1 if truncated == "judge" else 0) and len(judged) == (4 if truncated == "judge"
                                                                                        else 3)
    policy = {"drop": ([1.0, 1.0, 1.0, 0.0], [True, True, True, False]),
              "judge": ([1.0, 1.0, 1.0, 1.0], [True] * 4),
              "lose": ([1.0, 1.0, 1.0, 0.0], [True] * 4)}[truncated]
    assert (rb.reward_B[:4].tolist(), rb.keep_B[:4].tolist()) == policy
    assert rb.metrics["raro/policy_filtered_rate"] == (0.0 if truncated == "judge" else 0.25)


def test_a_critic_warm_up_masks_the_policy_rows_of_its_steps_only():
    """raro.critic_warmup_steps=2: at steps 1 and 2 the policy rows are judged and paid (their rewards logged)
    but left out of the update; the critic's rows train; at step 3 both roles train."""
    cfg = RaroConfig(critic_n=2, replay_buffer_ratio=0.0, critic_warmup_steps=2)
    generate, _ = _scripted_critic(lambda rec, j: "Verdict: Tie")
    for step, policy_trains in ((1, False), (2, False), (3, True)):
        prompts, groups = _policy_batch(2, 2)
        rb = _round(cfg, prompts, groups, ReplayBuffer(10), generate, step=step)
        assert rb.keep_B[:4].tolist() == [policy_trains] * 4 and rb.keep_B[4:].all()
        assert rb.paid_B.all() and rb.reward_B[:4].tolist() == pytest.approx([0.6] * 4)
        assert rb.metrics["raro/policy_masked_rate"] == 0.0


def test_answer_equality_ties_a_correct_answer_and_names_the_expert_otherwise():
    """raro.critic=answer_equality: no critic sampled; a correct policy answer is a Tie (tau_pol), a wrong one
    the expert's win (0); no critic rows; a cut answer dropped as usual. Without correctness: an error."""
    prompts, groups = _policy_batch(2, 2)
    groups[1][1] = _completion("<answer>cut off", finish="length")
    generate, seen = _scripted_critic(lambda rec, j: "Verdict: A")
    cfg = RaroConfig(critic="answer_equality", tau_pol=0.6)
    rb = critic_round(cfg, 1, 0, prompts, groups, ReplayBuffer(10), _Tokenizer(), generate,
                      Sampling(n=2, temperature=1.0, max_tokens=8), 10_000, correct=[True, False, True, True])
    assert seen == [] and not rb.is_critic_B.any() and len(rb.prompts) == 2
    assert rb.reward_B.tolist() == pytest.approx([0.6, 0.0, 0.6, 0.0])
    assert rb.keep_B.tolist() == [True, True, True, False]
    assert rb.metrics["raro/tie_rate"] == pytest.approx(2 / 3)
    assert rb.metrics["raro/expert_win_rate"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="needs the correctness of each of the 4 policy rows"):
        critic_round(cfg, 1, 0, prompts, groups, ReplayBuffer(10), _Tokenizer(), generate,
                     Sampling(n=2, temperature=1.0, max_tokens=8), 10_000)


def test_reward_mean_is_over_judged_policy_rows_with_the_masked_rate_beside_it():
    """RaroRound's samples: a filtered (cut) and an unjudged (unparseable replies) policy row have no reward,
    so ``reward/mean`` is the mean over the two judged rows (Tie: 0.6 each), not 0.6 * 2 / 4."""
    from types import SimpleNamespace

    from megareason.rewards.scoring import SampleResult
    from megareason.trainer.metrics import _sample_metrics
    from megareason.trainer.steps import RaroRound

    prompts, groups = _policy_batch(2, 2)
    groups[1][1] = _completion("<answer>cut off", finish="length")
    generate, _ = _scripted_critic(lambda rec, j: "no verdict" if "P0.0" in rec.prompt[-1]["content"]
                                   else "Verdict: Tie")
    scored = [SampleResult(index=i, sample=j, data_source="countdown", question="q", ground_truth="g",
                           response=c.text, reward=0.0, correct=False, response_tokens=len(c.token_ids),
                           truncated=c.finish_reason == "length")
              for i, g in enumerate(groups) for j, c in enumerate(g)]
    policy = SimpleNamespace(samples=lambda step, batch, timer: (batch, groups, scored), tokenizer=_Tokenizer(),
                             actors=SimpleNamespace(generate=generate))
    cfg = Config(algorithm=AlgorithmConfig(name="raro"), raro=RaroConfig(critic_n=2, replay_buffer_ratio=0.0))
    rows = RaroRound(cfg, policy, {})(1, prompts, {})
    assert [s.reward for s in rows.scored] == [None, pytest.approx(0.6), pytest.approx(0.6), None]
    m = _sample_metrics(rows.scored) | rows.metrics
    assert m["reward/mean"] == pytest.approx(0.6) and m["reward/masked_rate"] == 0.5
    assert json.loads(json.dumps(rows.scored[0].__dict__))["reward"] is None  # the rollout dump says so too


@pytest.mark.parametrize("ratio, fresh, historical", [(0.5, 8, 8), (0.25, 8, 3), (0.0, 8, 0)])
def test_replay_mix_follows_the_ratio_and_uses_earlier_steps_only(ratio, fresh, historical):
    buffer = ReplayBuffer(100, "fifo")
    buffer.add([_t(1000 + i) for i in range(50)])
    prompts, groups = _policy_batch(4, 2)
    generate, seen = _scripted_critic(lambda rec, j: "Verdict: Tie")
    cfg = RaroConfig(critic_n=2, replay_buffer_ratio=ratio, replay_order="sample_first")
    rb = _round(cfg, prompts, groups, buffer, generate)
    (critic_prompts, sampling), = seen
    flags = [p.record.extra_info["historical"] for p in critic_prompts]
    assert flags.count(False) == fresh and flags.count(True) == historical
    assert all(p.record.extra_info["index"] >= 1000 for p in critic_prompts if p.record.extra_info["historical"])
    assert rb.metrics["raro/historical_fraction"] == pytest.approx(historical / (fresh + historical))
    assert len(buffer) == 58  # this step's triplets were added after sampling
    assert sampling.n == 2 and sampling.seed == 100 + 4  # critic seeds follow the policy prompts'
    assert sampling.stop == ()  # the policy's stop strings are not the critic's


def test_raro_order_stores_the_fresh_triplets_before_drawing_the_historical_half():
    """RARO's training loop (the default): store (q, a_exp, a_pol), then build the critic batch 50% fresh + 50%
    from the buffer. On the first step the buffer holds only this step's 8 triplets, so the historical half
    is exactly those 8 (each judged twice, answers shuffled independently)."""
    assert RaroConfig().replay_order == "store_first" and RaroConfig().replay_buffer_kind == "fifo"
    assert RaroConfig().max_response_length == 4096 and RaroConfig().replay_buffer_ratio == 0.5
    buffer = ReplayBuffer(100, "fifo")
    prompts, groups = _policy_batch(4, 2)
    generate, seen = _scripted_critic(lambda rec, j: "Verdict: Tie")
    rb = _round(RaroConfig(critic_n=2), prompts, groups, buffer, generate)
    (critic_prompts, _), = seen
    by_kind = {h: sorted(re.search(r"P\d\.\d", p.text).group() for p in critic_prompts
                         if p.record.extra_info["historical"] == h) for h in (False, True)}
    assert by_kind[False] == [f"P{i}.{j}" for i in range(4) for j in range(2)] and by_kind[True] == by_kind[False]
    assert rb.metrics["raro/historical_fraction"] == 0.5 and len(buffer) == 8


def test_historical_sample_is_uniform_and_reproducible():
    buffer = ReplayBuffer(100, "fifo")
    buffer.add([_t(i) for i in range(20)])
    assert buffer.sample(5, seed=1) == buffer.sample(5, seed=1)
    counts = [0] * 20
    for s in range(2000):
        for t in buffer.sample(5, seed=s):
            counts[t.index] += 1
    assert min(counts) > 400 and max(counts) < 600  # expected 500 each
    assert len(buffer.sample(50, seed=0)) == 20


def test_raro_config_is_validated():
    from megareason.config import ConfigError, validate_training

    cfg = Config()
    cfg.algorithm.name = "raro"
    cfg.raro.replay_buffer_ratio = 1.0
    with pytest.raises(ConfigError, match="raro.replay_buffer_ratio"):
        validate_training(cfg)
    cfg.raro.replay_buffer_ratio = 0.5
    cfg.raro.critic_n = 1
    with pytest.raises(ConfigError, match="raro.critic_n"):
        validate_training(cfg)
    cfg.raro.critic_n = 2
    cfg.raro.critic, cfg.raro.critic_warmup_steps = "answer_equality", 3
    with pytest.raises(ConfigError, match=r"raro.critic_warmup_steps.*must be 0 with raro.critic=answer_equality"):
        validate_training(cfg)
    cfg.raro.critic_warmup_steps = -1
    cfg.raro.critic = "model"
    with pytest.raises(ConfigError, match=r"raro.critic_warmup_steps.*must be >= 0"):
        validate_training(cfg)


def test_random_module_untouched():
    # The critic pass draws from its own seeded generators, never the global one.
    random.seed(5)
    before = random.random()
    random.seed(5)
    prompts, groups = _policy_batch(2, 2)
    generate, _ = _scripted_critic(lambda rec, j: "Verdict: A")
    _round(RaroConfig(critic_n=2), prompts, groups, ReplayBuffer(10), generate)
    assert random.random() == before


def test_constrained_verdict_regex_matches_what_the_parser_reads():
    import re

    from megareason.raro.critic import verdict_regex

    assert verdict_regex(0) is None
    rx = verdict_regex(20)
    replies = [("short reason\nVerdict: A", "A"), ("\nVerdict: Tie", "tie"), ("x" * 20 + "\nVerdict: B", "B")]
    for reply, label in replies:
        assert re.fullmatch(rx, reply) and parse_label(reply) == label
    assert not re.fullmatch(rx, "x" * 21 + "\nVerdict: B")  # the reasoning budget is enforced
    assert not re.fullmatch(rx, "no verdict")


# --- reranking ---------------------------------------------------------------------------------------------


def test_tournament_winner_counts_wins_ties_and_breaks_ties_by_index():
    from megareason.raro.rerank import tournament_winner

    # 0 vs 1: 1 wins (shown as A); 0 vs 2: tie; 1 vs 2: 1 wins (shown as B); 2 vs 3 unparseable, ...
    results = {(1, 0): "A", (0, 2): "tie", (2, 1): "B", (2, 3): None, (0, 3): "A", (3, 1): "A"}
    # points: 0 -> 0.5 + 1 = 1.5; 1 -> 1 + 1 = 2; 2 -> 0.5 + 0.5 = 1; 3 -> 0.5 + 1 = 1.5
    assert tournament_winner(4, results) == 1
    assert tournament_winner(2, {(0, 1): "tie"}) == 0
    assert tournament_winner(2, {(1, 0): "A"}) == 1


def test_rerank_asks_every_pair_once_and_picks_the_critics_favourite():
    from megareason.raro.rerank import rerank

    class Engine:
        """Replays scripted verdicts, in the order rerank asks."""

        tokenizer = _Tokenizer()

        def __init__(self, verdicts):
            self.verdicts = verdicts

        def generate(self, token_ids, sampling):
            assert sampling.temperature == 0.0 and sampling.n == 1 and len(token_ids) == len(self.verdicts)
            return [[_completion(v)] for v in self.verdicts]

    prompts, groups = _policy_batch(2, 3)
    groups[0][2] = _completion("<answer>42</answer>")
    groups[1][0] = _completion("<answer>42</answer>")
    # A critic that always prefers the answer "42", in whichever position rerank shows it.
    import itertools

    rng = random.Random("rerank:0")
    queue = []
    for group in groups:
        for i, j in itertools.combinations(range(3), 2):
            a, b = (i, j) if rng.random() < 0.5 else (j, i)
            if "42" in group[a].text:
                queue.append("Verdict: A")
            elif "42" in group[b].text:
                queue.append("Verdict: B")
            else:
                queue.append("Verdict: Tie")
    assert rerank(Engine(queue), prompts, groups, RaroConfig(critic_max_tokens=16)) == [2, 0]

    # A pair whose critic prompt does not fit the context is not asked and counts as a tie.
    prompts, groups = _policy_batch(1, 3)
    groups[0] = [_completion("<answer>42</answer>"), _completion("<answer>7</answer>"),
                 _completion("<answer>" + "9" * 300 + "</answer>")]

    class Chars(_Tokenizer):
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    short = max(len(render(Chars(), critic_messages(CRITIC_SYSTEM_PROMPT, "question 0", x, y))[1])
                for x, y in (("42", "7"), ("7", "42")))
    asked = []

    class Judge:
        """Prefers the answer 42 wherever it is shown; records what it was asked."""

        tokenizer = Chars()

        def generate(self, token_ids, sampling):
            texts = ["".join(map(chr, ids)) for ids in token_ids]
            asked.extend(texts)
            return [[_completion("Verdict: A" if "Answer A:\n42\n" in t else "Verdict: B")] for t in texts]

    assert rerank(Judge(), prompts, groups, RaroConfig(critic_max_tokens=16), max_prompt_tokens=short) == [0]
    # 42 vs 7 only (42 wins): 42 scores 1 + 0.5 (a tie with the unasked long one), 9...9 0.5 + 0.5, 7 0 + 0.5
    assert len(asked) == 1 and "42" in asked[0] and "\n7\n" in asked[0] and len(asked[0]) <= short


def test_summarize_reports_the_reranked_accuracy():
    from megareason.rewards.scoring import SampleResult, summarize

    def s(index, sample, correct):
        return SampleResult(index=index, sample=sample, data_source="countdown", question="q", ground_truth="1",
                            response="r", reward=float(correct), correct=correct, response_tokens=3, truncated=False)

    samples = [s(0, 0, False), s(0, 1, True), s(1, 0, True), s(1, 1, False), s(2, 0, False), s(2, 1, False)]
    (summary,) = summarize(samples, 2, [1], picks=[1, 1, 0])
    assert summary.accuracy == pytest.approx(2 / 6)
    assert summary.rerank_accuracy == pytest.approx(1 / 3)  # picks: correct, wrong, wrong
    (summary,) = summarize(samples, 2, [1])
    assert summary.rerank_accuracy is None


@pytest.mark.parametrize("n_pol", [8, 3])  # 3: the mini-batches hold 1 and 2 policy rows, weighed apart
def test_every_mini_batch_weighs_the_roles_lambda_pol_to_lambda_crit(n_pol):
    """RARO's joint objective in every optimizer step: 8 policy rows of 10 tokens and 32 critic rows of
    3, token-mean, 2 mini-batches. Cut contiguously, the first mini-batch held 8 policy + 12 critic rows
    (effective weights 0.169 / 0.506) and the second only critic rows (0.0 / 1.63); each mini-batch now
    holds 4 + 16 rows, and its rows' weights give 1/9 and 8/9."""
    from megareason.algorithms.raro import role_mini_batches
    from megareason.trainer.experience import Experience
    from megareason.trainer.loop import mini_batch_rows
    from megareason.trainer.steps import StepRows

    B = n_pol + 32
    lengths = [10] * n_pol + [3] * 32
    mask_BT = torch.tensor([[1.0] * n + [0.0] * (10 - n) for n in lengths])
    exp = Experience(tokens_BT=torch.zeros(B, 10, dtype=torch.long), lengths_B=torch.tensor(lengths),
                     mask_BT=mask_BT, rollout_logp_BT=torch.zeros(B, 10))
    is_critic_B = torch.tensor([False] * n_pol + [True] * 32)
    reward_B = (torch.arange(B, dtype=torch.float32) % 5) ** 2  # groups of 5: 0, 1, 4, 9, 16 (mean 6: no zero)
    group_B = torch.arange(B) // 5
    cfg = Config(algorithm=AlgorithmConfig(name="raro", mini_batches=2))
    parts = mini_batch_rows(cfg, StepRows(exp, reward_B, group_B, is_critic_B, scored=[]))
    half = n_pol // 2
    assert [p.tolist() for p in parts] == [list(range(half)) + list(range(n_pol, n_pol + 16)),
                                           list(range(half, n_pol)) + list(range(n_pol + 16, B))]
    assert [p.tolist() for p in role_mini_batches(is_critic_B, 1)] == [list(range(B))]
    adv_BT = compute_advantages(cfg.algorithm, cfg.raro, exp, reward_B, group_B, is_critic_B, parts)["adv_BT"]
    from megareason.algorithms.advantages import grpo_advantages

    w_B = adv_BT[:, 0] / grpo_advantages(reward_B, group_B)  # each row's weight (every mask starts at column 0)
    for rows in parts:
        tokens_B = mask_BT[rows].sum(1)
        share = (w_B[rows] * tokens_B) / tokens_B.sum()  # each row's share of the mini-batch's token-mean
        pol, crit = float(share[~is_critic_B[rows]].sum()), float(share[is_critic_B[rows]].sum())
        assert (pol, crit) == (pytest.approx(1 / 9, rel=1e-5), pytest.approx(8 / 9, rel=1e-5))


def test_expert_template_shows_the_critic_the_demonstration_sft_imitates():
    """raro.expert_template: the expert's side of each triplet is the row's demonstration (as
    sft.response_template fills it), cut as a policy response is: <think> dropped, <answer> block kept."""
    prompts, groups = _policy_batch(2, 2)
    prompts[0].record.extra_info["solution"] = "E0 because reasons"
    generate, seen = _scripted_critic(lambda rec, j: f"Verdict: {_expert_position(rec)}")

    def expert_shown(template: str) -> list[str]:
        seen.clear()
        _round(RaroConfig(critic_n=2, replay_buffer_ratio=0.0, expert_template=template), prompts, groups,
               ReplayBuffer(10), generate)
        (critic_prompts, _), = seen
        out = []
        for p in critic_prompts:
            user = p.record.prompt[-1]["content"]
            a, b = re.search(r"Answer A:\n(.*)\n\nAnswer B:\n(.*)\n\nWhich", user, re.DOTALL).groups()
            out.append(a if p.record.ground_truth == "A" else b)
        return out

    assert set(expert_shown("")) == {"E0", "E1"}  # today's: extra_info expert_answer
    assert set(expert_shown("The final answer is \\boxed{{{answer}}}.")) == {
        "The final answer is \\boxed{E0}.", "The final answer is \\boxed{E1}."}
    assert set(expert_shown("<think>{solution}</think>\nSo: {answer}.")) == {"So: E0.", "So: E1."}
    assert set(expert_shown("<think>{solution}</think><answer>{answer}</answer>")) == {"E0", "E1"}


def test_a_bad_expert_template_is_refused_before_the_run_naming_the_field():
    from megareason.config import ConfigError, load_config, validate_training

    with pytest.raises(ConfigError, match=r"raro.expert_template .*'reasoning'.*\{solution\} and \{answer\}"):
        validate_training(load_config("raro_smollm2_cpu", ["raro.expert_template='{reasoning} {answer}'"]))
