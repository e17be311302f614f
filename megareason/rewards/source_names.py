"""Data-source names other projects write into their datasets, and the built-in family that scores each.

verl's ``default_compute_score`` (``verl/utils/reward_score/__init__.py``) picks a reward by the row's
``data_source``; its preprocessing scripts (``examples/data_preprocess/*.py``) write these names. A row
carrying one of them is scored here by the matching built-in family, with the family settings in
``SOURCE_SETTINGS`` put under the row's own ``extra_info`` (a row's own value wins). Where verl's reward
differs from the family's, the difference is noted beside the name.

``UNSUPPORTED_SOURCES``: names verl scores with something megareason does not have; looking one up raises
an error saying what it needs and how to plug a function of one's own in (``reward.by_source``).
"""

from __future__ import annotations

_MATH_NAMES = (
    # verl: boxed answer compared by its own normaliser; here the math family (boxed, math-verify).
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
    # verl: prime_math (boxed answer).
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads",
    # verl: geo3k, 0.9 * boxed-answer accuracy + 0.1 * <think> format; here the accuracy alone.
    "hiyouga/geometry3k",
)
# verl: math_dapo, the answer after the last "Answer:" and a score of +1 / -1; here the last boxed answer,
# else the text after the last "Answer:" line, and a score of 1 / 0.
_DAPO_NAMES = ("math_dapo", "math_dapo_reasoning")
# verl: search_r1_like_qa_em, exact match of the <answer> block; here multihop_qa with EM weight alone.
_SEARCH_R1_NAMES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                    "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")

_DAPO_SETTINGS = {"answer_prefix": "Answer:"}
_EXACT_MATCH_SETTINGS = {"em_weight": 1.0, "f1_weight": 0.0, "recall_weight": 0.0}

# name -> (family, family settings as extra_info defaults)
SOURCE_NAMES: dict[str, tuple[str, dict]] = {
    "openai/gsm8k": ("gsm8k", {}),  # verl: the number after the last "####", as the gsm8k family
    **{name: ("math", {}) for name in _MATH_NAMES},
    **{name: ("math", _DAPO_SETTINGS) for name in _DAPO_NAMES},
    **{name: ("multihop_qa", _EXACT_MATCH_SETTINGS) for name in _SEARCH_R1_NAMES},
}

# prefix -> (family, settings): verl sends every name starting with "aime" (aime2024, aime_2025, ...) to
# math_dapo.
SOURCE_PREFIXES: dict[str, tuple[str, dict]] = {"aime": ("math", _DAPO_SETTINGS)}

# name -> what verl scores it with, which megareason lacks.
UNSUPPORTED_SOURCES: dict[str, str] = {
    name: "runs the response's code against the row's test cases (verl: sandbox_fusion or prime_code); "
          "megareason has no code-execution reward"
    for name in ("codecontests", "apps", "codeforces", "taco")
}
