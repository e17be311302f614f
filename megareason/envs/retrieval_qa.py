"""Multi-hop retrieval QA (MuSiQue-style): the model searches the question's own documents, then answers.

One tool, ``search(query)``, returns the top-k documents of the question's corpus (MuSiQue: its 20
paragraphs) from the configured retriever (``envs.retrieval``). The model may search again on later
turns; a message without a tool call is its final answer, scored by the reward registry's
``multihop_qa`` family (EM, token F1, retrieval recall, hop weighting; or ``reward.custom``) with the
documents the model's own searches returned as ``retrieved_ids``; a scorer that raises gives 0 and
``score_error``. With ``initial_search`` the episode opens with a search the environment makes for the
question: its documents are shown to the model but not counted as retrieved by it (the recall term, from the
MuSiQue RLVR project, rewards retrieval, and a search the model did not make would pay every episode alike)
unless one of the model's own searches returns them again. The environment tracks the queries, the documents
shown, and the documents the answer cites (``[id]``), for the evaluation tables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megareason.data.musique import documents_of
from megareason.data.records import PromptRecord
from megareason.envs.base import StepResult
from megareason.envs.retrieval import Retriever, build_retriever
from megareason.envs.tools import call_tool, parse_tool_calls
from megareason.rewards import compute_score
from megareason.rewards.custom import Scorer
from megareason.rewards.multihop_qa import exact_match, extract_prediction, retrieval_recall_precision, token_f1
from megareason.rewards.pool import ScoreRequest, score_one

SYSTEM_PROMPT = (
    "Answer the user's question from the documents. You cannot see the documents: search them first with "
    "the search tool, as many times as you need, one query per call, for example\n"
    '<tool_call>{"name": "search", "arguments": {"query": "founder of Acme"}}</tool_call>\n'
    "When you know the answer, cite the documents you used by their id in brackets, like [3], and end with "
    "the final answer alone inside <answer></answer>, for example <answer>Paris</answer>."
)
_CITATION = re.compile(r"\[([^\[\]\s]{1,40})\]")


@dataclass(frozen=True)
class RetrievalQASettings:
    """The environment's settings (the config's ``env.*``, built by ``megareason.settings``)."""

    retriever: str  # envs.retrieval.RETRIEVERS
    top_k: int
    max_calls_per_turn: int  # further calls in one message get an error observation
    max_doc_chars: int  # each shown document is cut to this many characters
    system_prompt: str  # the config's env.system_prompt, else SYSTEM_PROMPT
    # Open the episode with the results of a search for the question itself (a tool call and its result
    # in the prompt, not trained on): retrieve-then-read, for models that rarely call tools unprompted.
    initial_search: bool


class RetrievalQAEnv:
    """One question's episode. ``retriever`` may be given (e.g. shared by the n samples of a prompt)."""

    def __init__(self, record: PromptRecord, settings: RetrievalQASettings,
                 retriever: Retriever | None = None, scorer: Scorer = compute_score):
        self.record, self.settings, self.scorer = record, settings, scorer
        self.docs = {d.id: d for d in documents_of(record, f"row {record.extra_info.get('index', '?')}")}
        self.retriever = retriever or build_retriever(settings.retriever, list(self.docs.values()))
        self.queries: list[str] = []
        self.retrieved: list[str] = []  # distinct document ids shown, in order of first showing
        self.opening: list[str] = []  # those the automatic opening search showed (env.initial_search)
        self.model_retrieved: list[str] = []  # those the model's own searches returned: what the reward pays
        self.tool_errors = 0
        self.last_message = ""
        self.tools: Sequence[Callable] = [self.search]

    def search(self, query: str) -> str:
        """Search the question's documents and return the best matches with their ids.

        Args:
            query: the words to search for
        """
        return self._search(query, self.model_retrieved)

    def _search(self, query: str, into: list[str]) -> str:
        """Run a search, record its documents as shown and in ``into``; the tool's reply."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the query must be a non-empty string")
        self.queries.append(query)
        shown = []
        for doc_id, _ in self.retriever.search(query, self.settings.top_k):
            doc = self.docs[doc_id]
            for ids in (self.retrieved, into):
                if doc_id not in ids:
                    ids.append(doc_id)
            shown.append(f"[{doc_id}] {doc.title}\n{doc.text[:self.settings.max_doc_chars]}")
        return "\n\n".join(shown) if shown else "No document matches."

    def reset(self) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.settings.system_prompt},
                *(m for m in self.record.prompt if m["role"] != "system")]
        if self.settings.initial_search:
            query = self.record.prompt[-1]["content"]
            call = json.dumps({"name": "search", "arguments": {"query": query}})
            msgs += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                     {"role": "tool", "content": self._search(query, self.opening)}]
        return msgs

    def step(self, message: str) -> StepResult:
        self.last_message = message
        calls = parse_tool_calls(message)
        if not calls:
            return self._score()
        tools = {"search": self.search}
        outputs = []
        for i, call in enumerate(calls):
            if i >= self.settings.max_calls_per_turn:
                out = f"Error: at most {self.settings.max_calls_per_turn} tool calls per message; this one was not run"
            else:
                out = call_tool(call, tools)
            self.tool_errors += out.startswith("Error:")
            outputs.append(out)
        return StepResult(observation="\n\n".join(outputs))

    def finish(self) -> StepResult:
        return self._score()

    def _score(self) -> StepResult:
        info = dict(self.record.extra_info)
        info["retrieved_ids"] = list(self.model_retrieved)  # not the opening search's
        info.pop("documents", None)  # the reward does not read them; keeps dumps small
        out = score_one(self.scorer, ScoreRequest(self.record.data_source, self.last_message,
                                                  self.record.ground_truth, info))
        return StepResult(reward=out.score, done=True, correct=out.correct,
                          info={**self.metrics(), **({"score_error": out.error} if out.error else {})})

    def metrics(self) -> dict:
        """The episode's answer and retrieval figures (JSON-safe). ``retrieval_recall`` / ``_precision`` are
        of the model's own retrieval (``model_retrieved_ids``, as the reward's); ``retrieved_ids`` are all
        the documents shown, ``opening_ids`` those of the opening search; ``searches`` counts it too."""
        golds = [self.record.ground_truth, *self.record.extra_info.get("answer_aliases", [])]
        pred = extract_prediction(self.last_message)
        supporting = [d.id for d in self.docs.values() if d.supporting]
        recall, precision = retrieval_recall_precision(self.model_retrieved, supporting)
        cited = [c for c in dict.fromkeys(_CITATION.findall(self.last_message)) if c in self.docs]
        cite_recall, cite_precision = retrieval_recall_precision(cited, supporting)
        return {"prediction": pred, "em": exact_match(pred, golds), "f1": token_f1(pred, golds),
                "retrieval_recall": recall, "retrieval_precision": precision, "searches": len(self.queries),
                "queries": list(self.queries), "retrieved_ids": list(self.retrieved), "opening_ids": list(self.opening),
                "model_retrieved_ids": list(self.model_retrieved), "cited_ids": cited,
                "citation_recall": cite_recall, "citation_precision": cite_precision,
                "tool_errors": self.tool_errors, "hops": int(self.record.extra_info.get("hops", 2))}


def make_envs(records: Sequence[PromptRecord], n: int, settings: RetrievalQASettings,
              scorer: Scorer = compute_score) -> list[RetrievalQAEnv]:
    """``n`` episodes per record, in (record, sample) order; the n samples of a record share its index."""
    envs = []
    for rec in records:
        first = RetrievalQAEnv(rec, settings, scorer=scorer)
        envs.append(first)
        envs += [RetrievalQAEnv(rec, settings, retriever=first.retriever, scorer=scorer) for _ in range(n - 1)]
    return envs
