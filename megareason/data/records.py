"""Typed records that cross module boundaries (data -> rollout -> rewards -> evaluation/trainer), and
``DataError``, the error every layer raises for bad input data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """Bad input data; the message names the file, the row and the field."""


@dataclass
class PromptRecord:
    """One prompt, in the verl convention.

    prompt:       chat messages ``[{"role": ..., "content": ...}]`` without the assistant's answer.
    data_source:  selects the reward function (see ``megareason.rewards``).
    ground_truth: the reference final answer, as text.
    extra_info:   JSON-safe per-row details: ``index``, ``question``, ``solution`` (the expert's
                  reasoning, when known), ``expert_answer`` (the expert's final answer for RARO when
                  it is not ``ground_truth``, e.g. countdown's expression) and whatever a reward needs
                  (e.g. countdown's ``numbers``).
    chat:         the row gave its prompt as chat messages (verl's rows, TRL's conversational format);
                  False: as text (TRL's standard format, question/answer rows, generated items). A TRL
                  reward function gets the row in that format (``reward.trl_format=auto``), as TRL
                  decides it from the data (``trl.data_utils.is_conversational``).
    """

    prompt: list[dict[str, str]]
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    chat: bool = False


@dataclass
class TokenizedPrompt:
    """A record with its chat template applied: ``token_ids`` is what the engine is given."""

    record: PromptRecord
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Document:
    """One document of a question's own corpus (MuSiQue: one of its paragraphs), as the retrievers
    (``envs.retrieval``) search them; ``data.musique.documents_of`` reads them from a record."""

    id: str  # unique within the question's corpus (MuSiQue: the paragraph's idx)
    title: str
    text: str
    supporting: bool = False
