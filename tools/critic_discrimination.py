"""Does a RARO critic tell the expert's answer from the policy's? The check to run before a RARO result
means anything: the critic (a model's weights, with the run's ``raro`` settings) judges, for every held-out
question, the expert's demonstration against a policy's held-out response (a run's per-prompt rows from
``tools/compare_methods.py``), once with the expert's answer shown as A and once as B, greedily. It reports
the share of judgements that name the expert (a tie or no verdict counts as not naming it; 0.5 is a coin
flip, and a critic that always says A scores 0.5 too), the same among the pairs whose policy answer is wrong
(the expert's is right: a critic that checks correctness names it), and the share of ties. RARO is testable
with a critic at ``THRESHOLD`` or above on the wrong-answer pairs.

    .venv/bin/python tools/critic_discrimination.py MODEL ROWS.jsonl [--config compare_multiply_smollm2_cpu]
      [key=value ...]

MODEL: an HF folder (a RARO run's exported final checkpoint: policy and critic share the weights) or a
known model name; ROWS: per-prompt rows (``compare_methods_prompts/ARM_seedS.jsonl``) of the policy whose
answers are judged. The expert's demonstration is the config's ``raro.expert_template`` over the worked
solution the loader writes for the question (``megareason.data.arithmetic.worked_solution``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megareason.algorithms.raro import Verdict, parse_label, to_role  # noqa: E402
from megareason.data.arithmetic import worked_solution  # noqa: E402
from megareason.data.records import PromptRecord  # noqa: E402
from megareason.raro.critic import expert_answer  # noqa: E402
from megareason.raro.prompts import CRITIC_SYSTEM_PROMPT, critic_messages, policy_answer  # noqa: E402

THRESHOLD = 0.7
_QUESTION = re.compile(r"Calculate (.+?)\.?$")


def pairs(rows: list[dict], template: str) -> list[dict]:
    """One pair per per-prompt row: the question, the expert's answer (``template`` over the worked solution
    of the question's expression), the policy's answer as the critic is shown it, and whether the policy's
    answer was correct (strict)."""
    out = []
    for r in rows:
        m = _QUESTION.fullmatch(r["question"].strip())
        if m is None:
            raise ValueError(f"row {r['id']}: question {r['question']!r} is not 'Calculate EXPRESSION.'")
        rec = PromptRecord(prompt=[{"role": "user", "content": r["question"]}], data_source="basic_arithmetic",
                           ground_truth=r["gold"], extra_info={"solution": worked_solution(m.group(1), r["gold"]),
                                                               "index": r["id"]})
        out.append({"id": r["id"], "question": r["question"], "expert": expert_answer(rec, template),
                    "policy": policy_answer(r["response"]), "policy_correct": bool(r["correct"])})
    return out


def judgements(pairs_: list[dict], system_prompt: str) -> list[tuple[dict, bool, list[dict]]]:
    """(pair, expert shown first, the critic's chat) for each pair in both orders."""
    return [(p, first, critic_messages(system_prompt, p["question"], *((p["expert"], p["policy"]) if first
                                                                      else (p["policy"], p["expert"]))))
            for p in pairs_ for first in (True, False)]


def discrimination(judged: list[tuple[dict, bool]], replies: list[str]) -> dict:
    """The shares naming the expert (over all judgements, and over those of pairs with a wrong policy
    answer), of ties, and of replies without a verdict."""
    verdicts = [(p, to_role(parse_label(text), first)) for (p, first), text in zip(judged, replies, strict=True)]

    def share(subset, what):
        return sum(v is what for _, v in subset) / len(subset) if subset else float("nan")

    wrong = [(p, v) for p, v in verdicts if not p["policy_correct"]]
    return {"judgements": len(verdicts), "names_expert": share(verdicts, Verdict.EXPERT),
            "wrong_pairs": len(wrong) // 2, "names_expert_wrong": share(wrong, Verdict.EXPERT),
            "tie": share(verdicts, Verdict.TIE), "no_verdict": share(verdicts, None),
            "testable": share(wrong, Verdict.EXPERT) >= THRESHOLD}


def measure(rows: list[dict], cfg, generate: Callable[[list[list[dict]]], list[str]]) -> dict:
    """``discrimination`` of the critic behind ``generate`` (critic chats -> one reply each, greedy)."""
    ps = pairs(rows, cfg.raro.expert_template)
    judged = judgements(ps, cfg.raro.critic_system_prompt or CRITIC_SYSTEM_PROMPT)
    return discrimination([(p, first) for p, first, _ in judged], generate([chat for _, _, chat in judged]))


def vllm_critic(model: str, cfg):
    """A greedy critic on ``model`` through the project's engine, with the run's verdict constraint."""
    from megareason.raro.critic import verdict_regex
    from megareason.raro.prompts import render
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import Sampling
    from megareason.settings import one_engine_settings

    engine = VLLMEngine(one_engine_settings(model, cfg.rollout.max_model_len, cfg.rollout))
    sampling = Sampling(n=1, temperature=0.0, max_tokens=cfg.raro.critic_max_tokens,
                        regex=verdict_regex(cfg.raro.constrain_verdict_chars))

    def generate(chats: list[list[dict]]) -> list[str]:
        ids = [render(engine.tokenizer, chat)[1] for chat in chats]
        return [c[0].text for c in engine.generate(ids, sampling)]

    return generate


def main() -> None:
    from megareason.config.load import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("rows", type=Path)
    ap.add_argument("--config", default="compare_smollm2_cpu")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = load_config(a.config, a.overrides)
    rows = [json.loads(x) for x in a.rows.read_text().splitlines() if x.strip()]
    print(json.dumps(measure(rows, cfg, vllm_critic(a.model, cfg)), indent=2))


if __name__ == "__main__":
    main()
