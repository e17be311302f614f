"""TinyV: a small LLM verifier that recovers the rule verifier's false negatives.

After "TinyV: Reducing False Negatives in Verification Improves RL for LLM Reasoning" (Xu et al.,
2025). A sample whose data_source is ``<source>_tinyv`` is first scored by ``<source>``'s rule reward
(``registry.base_source``); ``apply_tinyv`` then asks a verifier model, served over an
OpenAI-compatible API (``megareason serve-verifier``), whether the response's final answer is
equivalent to the reference answer, and combines the two by ``TinyVConfig.mode``:

- ``tinyv_only``: score = 1 if the verifier says True else 0; every sample is asked.
- ``addon``: only samples the rule reward marked wrong are asked; True makes them correct and worth
  ``weight`` (seed 001: ``verdict * tinyv_weight``; here ``max(rule score, weight)``, the same for
  rules that give a wrong answer 0, so a rule's partial credit is never lowered by a True). Samples the
  rule marked right keep the rule outcome (1 for math).
- ``mixed``: score = (1 - weight) * rule score + weight * verdict; every sample is asked.

The defaults (``TinyVConfig``) are seed 001's run script: ``tinyv_only`` with weight 1.0. ``correct``
is the verdict in ``tinyv_only`` and "rule correct or verdict True" otherwise. A sample asked but given
no verdict (server unreachable after the retries, an HTTP 4xx, an unparseable reply) is scored as if the
verifier said False (``fallback="zero"``, the default: seed 001's verifier call returns 0 when it fails)
or keeps its rule outcome (``"rule"``), and is counted either way: in the stats and as a
``score_error`` starting with ``TinyVFallback``.

The client uses only the standard library (urllib in a thread pool) and talks to the server
directly, ignoring ``http_proxy``: a verifier runs beside the trainer, not behind a proxy.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megareason.config.schema import TinyVConfig
from megareason.rewards.math import last_boxed
from megareason.rewards.pool import ScoreOutcome, ScoreRequest
from megareason.rewards.registry import TINYV_SUFFIX

log = logging.getLogger(__name__)

CHOICES = ("True", "False")
FALLBACK_ERROR = "TinyVFallback"  # prefix of the score_error of a sample that got no verdict
_MAX_TOKENS = 8  # "True"/"False" plus end of text, even for a byte-level tokenizer
_MAX_ANSWER_CHARS = 1000  # a runaway "final line" is cut (its end kept) to fit the verifier's context
_VERDICT = re.compile(r"\b(true|false)\b", re.IGNORECASE)
# Errors worth another attempt: refused/reset connections, timeouts, HTTP 5xx, truncated replies.
# (urllib's HTTPError and URLError are OSErrors; an HTTP 4xx is re-raised before this is consulted.)
_RETRYABLE = (OSError, http.client.HTTPException)

PROMPT = """\
You judge whether a model's final answer to a question is correct. It is correct when it is \
equivalent to the reference answer, even if written differently (another form of the same number, \
expression, set or interval; other formatting or units that do not change the value).

<question>
{question}
</question>

<reference_answer>
{reference}
</reference_answer>

<model_answer>
{answer}
</model_answer>

Reply with exactly one word: True if the model's answer is correct, otherwise False."""


@dataclass(frozen=True)
class VerifyItem:
    """One question for the verifier: is ``answer`` (a response's final answer) equal to ``reference``?"""

    question: str
    reference: str
    answer: str


def is_tinyv(data_source: str) -> bool:
    """Whether samples of ``data_source`` go through TinyV after their rule reward."""
    return data_source.endswith(TINYV_SUFFIX)


def final_answer(response: str) -> str:
    """The last ``\\boxed{}`` answer of ``response``, else its last non-empty line ("" if none)."""
    answer = last_boxed(response)
    if answer is None:
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        answer = lines[-1] if lines else ""
    return answer[-_MAX_ANSWER_CHARS:]


def parse_verdict(reply: str) -> bool | None:
    """The first word "true" or "false" of ``reply`` (any case); None if there is none."""
    m = _VERDICT.search(reply)
    return None if m is None else m.group(1).lower() == "true"


class VerifierClient:
    """Asks an OpenAI-compatible server (``POST {base_url}/v1/chat/completions``) for verdicts.

    Each request is sent with ``temperature 0`` and a small ``max_tokens``, times out after
    ``timeout_s`` and is retried up to ``max_retries`` times, pausing ``backoff_s * 2**k`` before
    retry ``k + 1``, on connection errors, timeouts and HTTP 5xx (not on 4xx). ``choices`` (e.g.
    ``CHOICES``) constrains the reply with vLLM's ``structured_outputs: {"choice": [...]}``; vLLM
    0.32 ignores the older ``guided_choice``. An empty ``model`` means the first model the server
    lists at ``/v1/models``.
    """

    def __init__(self, base_url: str, model: str, timeout_s: float, max_retries: int, backoff_s: float,
                 concurrency: int, choices: Sequence[str] | None = None):
        if concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"VerifierClient needs concurrency >= 1, max_retries >= 0, timeout_s > 0 and "
                             f"backoff_s >= 0; got {concurrency}, {max_retries}, {timeout_s}, {backoff_s}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.concurrency = concurrency
        self.choices = list(choices) if choices else None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def from_config(cls, cfg: TinyVConfig) -> VerifierClient:
        return cls(cfg.base_url, cfg.model, cfg.timeout_s, cfg.max_retries, cfg.backoff_s, cfg.concurrency,
                   choices=CHOICES if cfg.constrain_choices else None)

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[bool | None]:
        """One verdict per item, in order (``concurrency`` requests in flight); None when the server
        could not be reached, refused the request, or replied without a True/False word.

        One ``GET /v1/models`` first names the model (if not given) and finds a dead server after one
        round of retries, instead of one round per item.
        """
        if not items:
            return []
        try:
            models = [m["id"] for m in self._request("/v1/models", None)["data"]]
            if not (self.model or models):
                raise ValueError("/v1/models lists no model")
            model = self.model or models[0]
        except Exception as e:  # a dead server is the fallback's business, not an exception
            log.warning("TinyV verifier %s: unavailable, no verdicts for %d samples: %s: %s",
                        self.base_url, len(items), type(e).__name__, e)
            return [None] * len(items)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as ex:
            results = list(ex.map(lambda item: self._verify_one(model, item), items))
        failures = [err for _, err in results if err]
        if failures:
            log.warning("TinyV verifier %s: no verdict for %d of %d samples; first: %s",
                        self.base_url, len(failures), len(items), failures[0])
        return [verdict for verdict, _ in results]

    def _verify_one(self, model: str, item: VerifyItem) -> tuple[bool | None, str]:
        """(verdict, "") or (None, why not)."""
        body = {"model": model,
                "messages": [{"role": "user", "content": PROMPT.format(
                    question=item.question, reference=item.reference, answer=item.answer)}],
                "temperature": 0, "max_tokens": _MAX_TOKENS}
        if self.choices:
            body["structured_outputs"] = {"choice": self.choices}
        try:
            reply = self._request("/v1/chat/completions", body)
            text = reply["choices"][0]["message"]["content"] or ""
        except Exception as e:  # one sample's failure must not lose the batch; it falls back instead
            return None, f"{type(e).__name__}: {e}"
        verdict = parse_verdict(text)
        return verdict, "" if verdict is not None else f"unparseable reply {text[:100]!r}"

    def _request(self, path: str, body: dict | None) -> dict:
        """GET (``body`` None) or POST JSON to ``path``, with the timeout and retries; the decoded reply."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.max_retries + 1):
            req = urllib.request.Request(self.base_url + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == self.max_retries:
                    detail = e.read()[:300].decode(errors="replace")
                    raise RuntimeError(f"HTTP {e.code} from {path}: {detail}") from None
            except _RETRYABLE:
                if attempt == self.max_retries:
                    raise
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")


def needs_verdict(rule: ScoreOutcome, mode: str) -> bool:
    """Whether the verifier is asked about a sample with this rule outcome (addon: only if wrong)."""
    return not rule.correct if mode == "addon" else True


def tinyv_scores(rule_outcomes: Sequence[ScoreOutcome], verdicts: Sequence[bool | None], mode: str,
                 weight: float) -> list[ScoreOutcome]:
    """Combine rule outcomes with verdicts (see the module docstring); pure.

    A ``None`` verdict (not asked, or no answer under ``fallback="rule"``) keeps the rule outcome.
    ``error``/``timed_out`` of the rule outcome are kept.
    """
    if mode not in ("tinyv_only", "addon", "mixed"):
        raise ValueError(f"TinyV mode must be tinyv_only, addon or mixed, got {mode!r}")
    out = []
    for rule, v in zip(rule_outcomes, verdicts, strict=True):
        if v is None:
            out.append(rule)
        elif mode == "tinyv_only":
            out.append(dataclasses.replace(rule, score=float(v), correct=v))
        elif mode == "addon":
            upgrade = v and not rule.correct
            out.append(dataclasses.replace(rule, score=max(rule.score, weight), correct=True) if upgrade else rule)
        else:
            out.append(dataclasses.replace(rule, score=(1 - weight) * rule.score + weight * float(v),
                                           correct=rule.correct or v))
    return out


def apply_tinyv(requests: Sequence[ScoreRequest], rule_outcomes: Sequence[ScoreOutcome],
                cfg: TinyVConfig) -> tuple[list[ScoreOutcome], dict[str, int]]:
    """Rescore a batch with the verifier: every request is taken as TinyV-routed (the caller picks
    them). The question shown to the verifier is ``extra_info["question"]`` ("" if absent).

    Returns the outcomes, in order, and counts: ``asked`` (requests sent to the verifier),
    ``upgraded`` (asked, wrong by the rule, True by the verifier) and ``fallbacks`` (asked, no verdict).
    """
    asked = [i for i, o in enumerate(rule_outcomes) if needs_verdict(o, cfg.mode)]
    items = [VerifyItem(question=str(requests[i].extra_info.get("question", "")),
                        reference=requests[i].ground_truth, answer=final_answer(requests[i].response))
             for i in asked]
    answers = VerifierClient.from_config(cfg).verify_batch(items)
    missing = [i for i, v in zip(asked, answers, strict=True) if v is None]
    no_verdict = None if cfg.fallback == "rule" else False  # "zero": as if the verifier said False
    verdicts: list[bool | None] = [None] * len(requests)
    for i, v in zip(asked, answers, strict=True):
        verdicts[i] = no_verdict if v is None else v
    outcomes = tinyv_scores(rule_outcomes, verdicts, cfg.mode, cfg.weight)
    what = "kept the rule outcome" if cfg.fallback == "rule" else "scored as False"
    for i in missing:
        rule = outcomes[i]
        error = "; ".join(e for e in (rule.error, f"{FALLBACK_ERROR}: the verifier gave no verdict; {what}") if e)
        outcomes[i] = dataclasses.replace(rule, error=error)
    stats = {"asked": len(asked), "fallbacks": len(missing),
             "upgraded": sum(bool(v) and not rule_outcomes[i].correct for i, v in zip(asked, answers, strict=True))}
    if missing:
        log.warning("TinyV: %d of %d asked samples fell back (fallback=%s)", len(missing), len(asked), cfg.fallback)
    return outcomes, stats
