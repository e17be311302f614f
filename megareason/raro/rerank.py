"""Test-time reranking with a RARO critic: pick the best of k sampled answers by a pairwise tournament.

Every pair (i, j) of a prompt's k answers is shown to the critic once (its order drawn from a seeded
generator, so position bias averages out over pairs); the critic is asked, as in training, which
answer is "the expert's". That answer scores 1, the other 0; Tie, an unparseable judgement, or a pair
whose critic prompt does not fit the engine (``max_prompt_tokens``; not asked, counted in a warning) gives
both 0.5. The answer with the most points wins (the lowest index among equals).
``megareason eval`` with ``eval.rerank=critic`` reports the winner's accuracy beside the
single-sample accuracy.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence

from megareason.algorithms.raro import parse_label
from megareason.config.schema import RaroConfig
from megareason.data.records import TokenizedPrompt
from megareason.raro.critic import verdict_regex
from megareason.raro.prompts import CRITIC_SYSTEM_PROMPT, critic_messages, policy_answer, render
from megareason.rollout.records import Completion, Sampling

log = logging.getLogger(__name__)


def tournament_winner(k: int, results: dict[tuple[int, int], str | None]) -> int:
    """``results[(i, j)]`` is the label for answer i shown as A and j as B ("A", "B", "tie" or None);
    every unordered pair appears once, in either order. Returns the index of the winner."""
    points = [0.0] * k
    for (i, j), label in results.items():
        if label == "A":
            points[i] += 1
        elif label == "B":
            points[j] += 1
        else:
            points[i] += 0.5
            points[j] += 0.5
    return max(range(k), key=lambda a: (points[a], -a))


def rerank(engine, prompts: Sequence[TokenizedPrompt], groups: Sequence[Sequence[Completion]], cfg: RaroConfig,
           seed: int = 0, max_prompt_tokens: int | None = None) -> list[int]:
    """The index of the winning completion of each prompt (greedy critic judgements). Critic prompts
    longer than ``max_prompt_tokens`` (the engine's context less ``raro.critic_max_tokens``) are not asked."""
    rng = random.Random(f"rerank:{seed}")
    tokenizer = engine.tokenizer
    system = cfg.critic_system_prompt or CRITIC_SYSTEM_PROMPT
    results: list[dict[tuple[int, int], str | None]] = [{} for _ in prompts]
    pairs, token_ids = [], []
    for p, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        question = str(prompt.record.extra_info.get("question", prompt.record.prompt[-1]["content"]))
        for i, j in itertools.combinations(range(len(group)), 2):
            a, b = (i, j) if rng.random() < 0.5 else (j, i)
            messages = critic_messages(system, question, policy_answer(group[a].text), policy_answer(group[b].text))
            ids = render(tokenizer, messages)[1]
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                results[p][(a, b)] = None  # a tie
                continue
            token_ids.append(ids)
            pairs.append((p, a, b))
    if skipped := sum(len(r) for r in results):
        log.warning("critic reranking: %d of %d pairs not judged (critic prompt over %d tokens: raise "
                    "rollout.max_model_len or lower raro.critic_max_tokens); each counts as a tie",
                    skipped, skipped + len(pairs), max_prompt_tokens)
    greedy = Sampling(n=1, temperature=0.0, max_tokens=cfg.critic_max_tokens,
                      regex=verdict_regex(cfg.constrain_verdict_chars))
    judgements = engine.generate(token_ids, greedy) if token_ids else []
    for (p, a, b), (c,) in zip(pairs, judgements, strict=True):
        results[p][(a, b)] = parse_label(c.text)
    return [tournament_winner(len(g), r) for g, r in zip(groups, results, strict=True)]
