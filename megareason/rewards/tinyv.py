"""TinyV and rubric-reward-model (RRM) verifiers: an LLM rescores the rule verifier's samples.

After "TinyV: Reducing False Negatives in Verification Improves RL for LLM Reasoning" (Xu et al.,
2025) and the rubric-reward-model recipe that serves a rubric reward model (trained on the ``grade``
source) as TinyV's verifier. A sample whose data_source is ``<source>_tinyv`` is first scored by
``<source>``'s rule reward (``registry.base_source``); ``apply_tinyv`` then asks a verifier model, served
over an OpenAI-compatible API (``megareason serve-verifier``), and combines the two. What the verifier
is asked is ``TinyVConfig.verifier``:

- ``tinyv``: whether the response's final answer is equivalent to the reference answer (``PROMPT``,
  at most 8 tokens); the verdict ``v`` is 1 for "True" and 0 for "False".
- ``rrm``: to grade the full response against the row's rubric, ``extra_info["criteria"]`` (a text;
  ``RRM_PROMPT``, up to ``rrm_max_tokens`` tokens). The reply is read by the ``grade`` reward's parser
  (``rubric.extract_grade``: the number after the last "Total Score") and ``v = min(10, X) / 10``
  (a negative ``X`` reads 0).

The combinations (``TinyVConfig.mode``) are those of the recipe's run script, ``VERIFIER_SETUP``:

- ``tinyv_only`` ("uses RRM exclusively for verification, without using rule-based verifiers
  entirely"): score = ``v``; every sample is asked.
- ``addon`` ("TinyV is triggered only when the rule-based verifier determines the answer is
  incorrect"): samples the rule marked right keep the rule outcome (1 for math); the others are asked
  and score ``max(rule score, weight * v)`` (the public verifier code: ``v * tinyv_weight``; the same for
  rules that give a wrong answer 0, and a rule's partial credit is never lowered).
- ``mixed`` (named by the script; its formula is TinyV's): score = ``(1 - weight) * rule score +
  weight * v``; every sample is asked.

The defaults are the run script's: ``tinyv_only`` with weight 1.0. A verdict is positive when ``v >= 0.5``
(TinyV: "True"): ``correct`` is that in ``tinyv_only`` and "rule correct or positive" otherwise.

A sample asked but given no verdict (server unreachable after the retries, a timeout, an HTTP 4xx, an
unparseable reply) is scored as if ``v = 0`` (``fallback="zero"``, the default: the public verifier
code returns 0 when its call fails) or keeps its rule outcome (``"rule"``), and is counted either way:
in the stats (``fallbacks``, and ``timeouts`` for those that timed out) and as a ``score_error``
starting with ``TinyVFallback`` (``TinyVFallback (timeout)`` for a timeout).

The first replies a server gives are read once per process (``check_verifier_kind``): under
``verifier=tinyv`` a first batch without a single True/False (a rubric model served under the default
writes grading prose) stops the run with ``reward.tinyv.verifier`` named, and under ``rrm`` so does a
first batch of bare True/False replies (a TinyV model), rather than scoring every sample as a verdict of 0.

The client uses only the standard library (urllib in a thread pool) and talks to the server
directly, ignoring ``http_proxy``: a verifier runs beside the trainer, not behind a proxy. Every
request has a timeout and a bounded number of retries, so a hung server costs at most
``(max_retries + 1) * timeout_s`` plus the backoff per batch of ``concurrency`` requests, never a hang.
Not the OpenAI client: its retries also wait on HTTP 429 for as long as the server's ``Retry-After`` asks,
so a batch's time would be the server's to choose rather than bounded as above.
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megareason.config.schema import TinyVConfig
from megareason.rewards.math import last_boxed
from megareason.rewards.pool import ScoreOutcome, ScoreRequest
from megareason.rewards.registry import TINYV_SUFFIX
from megareason.rewards.rubric import MAX_GRADE, extract_grade

log = logging.getLogger(__name__)

CHOICES = ("True", "False")
FALLBACK_ERROR = "TinyVFallback"  # prefix of the score_error of a sample that got no verdict
TIMEOUT_ERROR = f"{FALLBACK_ERROR} (timeout)"  # ... of one whose verifier request timed out
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

# The rubric reward model's grading request (placeholders {question}, {criteria}, {solution}); a model
# trained with another wording is given its own with reward.tinyv.rrm_template.
RRM_PROMPT = """\
You are grading a student's solution to a question. Read the question, the scoring criteria and the \
solution, then award points according to the criteria, out of 10 points in total.

<question>
{question}
</question>

<criteria>
{criteria}
</criteria>

<solution>
{solution}
</solution>

Explain briefly how the solution meets each criterion, then end with a line "Total Score: X/10"."""


@dataclass(frozen=True)
class VerifyItem:
    """One question for the verifier: is ``answer`` (a response's final answer) equal to ``reference``?"""

    question: str
    reference: str
    answer: str


@dataclass(frozen=True)
class Reply:
    """The verifier's reading of one request: ``value`` (a TinyV verdict or an RRM score in [0, 1]) or
    None with ``error`` saying why; ``timed_out`` when the last attempt (or the server check) timed out."""

    value: bool | float | None
    error: str = ""
    timed_out: bool = False
    text: str | None = None  # the reply's text; None when no reply came


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


def parse_rrm_score(reply: str) -> float | None:
    """``min(10, X) / 10`` for the grade ``X`` the ``grade`` reward reads in ``reply`` (a negative ``X``
    reads 0); None when it reads none."""
    grade = extract_grade(reply)
    return None if grade is None else float(min(max(grade, 0), MAX_GRADE) / MAX_GRADE)


def rubric_criteria(extra_info: dict, where: str) -> str:
    """The row's rubric, ``extra_info["criteria"]``; ``ValueError`` naming ``where`` if it is not a
    non-empty text."""
    criteria = extra_info.get("criteria")
    if not isinstance(criteria, str) or not criteria.strip():
        raise ValueError(f"{where}: reward.tinyv.verifier=rrm grades each _tinyv row by its rubric, "
                         f"extra_info.criteria, which must be a non-empty text; got {criteria!r}")
    return criteria


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or (isinstance(e, urllib.error.URLError) and isinstance(e.reason, TimeoutError))


class VerifierClient:
    """Asks an OpenAI-compatible server (``POST {base_url}/v1/chat/completions``) for verdicts.

    Each request is sent with ``temperature 0`` and ``max_tokens``, times out after ``timeout_s``
    and is retried up to ``max_retries`` times, pausing ``backoff_s * 2**k`` before retry ``k + 1``,
    on connection errors, timeouts and HTTP 5xx (not on 4xx). ``choices`` (e.g. ``CHOICES``)
    constrains the reply with vLLM's ``structured_outputs: {"choice": [...]}``; vLLM 0.32 ignores the
    older ``guided_choice``. An empty ``model`` means the first model the server lists at ``/v1/models``.
    """

    def __init__(self, base_url: str, model: str, timeout_s: float, max_retries: int, backoff_s: float,
                 concurrency: int, choices: Sequence[str] | None = None, max_tokens: int = _MAX_TOKENS):
        if concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0 or max_tokens < 1:
            raise ValueError(f"VerifierClient needs concurrency >= 1, max_retries >= 0, timeout_s > 0, backoff_s "
                             f">= 0 and max_tokens >= 1; got {concurrency}, {max_retries}, {timeout_s}, "
                             f"{backoff_s}, {max_tokens}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.concurrency = concurrency
        self.choices = list(choices) if choices else None
        self.max_tokens = max_tokens
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def from_config(cls, cfg: TinyVConfig) -> VerifierClient:
        """TinyV: a True/False reply of ``_MAX_TOKENS``; RRM: a graded reply of ``cfg.rrm_max_tokens``."""
        rrm = cfg.verifier == "rrm"
        return cls(cfg.base_url, cfg.model, cfg.timeout_s, cfg.max_retries, cfg.backoff_s, cfg.concurrency,
                   choices=CHOICES if cfg.constrain_choices and not rrm else None,
                   max_tokens=cfg.rrm_max_tokens if rrm else _MAX_TOKENS)

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[bool | None]:
        """TinyV's verdict per item, in order; None when the server could not be reached, refused the
        request, or replied without a True/False word."""
        prompts = [PROMPT.format(question=i.question, reference=i.reference, answer=i.answer) for i in items]
        return [r.value for r in self.ask_batch(prompts, parse_verdict)]

    def ask_batch(self, prompts: Sequence[str], parse: Callable[[str], bool | float | None]) -> list[Reply]:
        """One ``Reply`` per prompt, in order (``concurrency`` requests in flight), read by ``parse``
        (None: unparseable).

        One ``GET /v1/models`` first names the model (if not given) and finds a dead server after one
        round of retries, instead of one round per prompt.
        """
        if not prompts:
            return []
        try:
            models = [m["id"] for m in self._request("/v1/models", None)["data"]]
            if not (self.model or models):
                raise ValueError("/v1/models lists no model")
            model = self.model or models[0]
        except Exception as e:  # a dead server is the fallback's business, not an exception
            log.warning("TinyV verifier %s: unavailable, no verdicts for %d samples: %s: %s",
                        self.base_url, len(prompts), type(e).__name__, e)
            return [Reply(None, f"verifier unavailable: {type(e).__name__}: {e}", _is_timeout(e))] * len(prompts)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as ex:
            replies = list(ex.map(lambda p: self._ask_one(model, p, parse), prompts))
        failures = [r.error for r in replies if r.value is None]
        if failures:
            log.warning("TinyV verifier %s: no verdict for %d of %d samples (%d timed out); first: %s",
                        self.base_url, len(failures), len(prompts), sum(r.timed_out for r in replies), failures[0])
        return replies

    def _ask_one(self, model: str, prompt: str, parse: Callable[[str], bool | float | None]) -> Reply:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": self.max_tokens}
        if self.choices:
            body["structured_outputs"] = {"choice": self.choices}
        try:
            reply = self._request("/v1/chat/completions", body)
            text = reply["choices"][0]["message"]["content"] or ""
        except Exception as e:  # one sample's failure must not lose the batch; it falls back instead
            what = f"timed out after {self.max_retries + 1} tries of {self.timeout_s:g}s" if _is_timeout(e) else ""
            return Reply(None, what or f"{type(e).__name__}: {e}", _is_timeout(e))
        value = parse(text)
        return Reply(value, "" if value is not None else f"unparseable reply {text[:100]!r}", text=text)

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


def tinyv_scores(rule_outcomes: Sequence[ScoreOutcome], verdicts: Sequence[bool | float | None], mode: str,
                 weight: float) -> list[ScoreOutcome]:
    """Combine rule outcomes with verdicts ``v`` in [0, 1] (a bool is 1/0; see the module docstring); pure.

    A ``None`` verdict (not asked, or no answer under ``fallback="rule"``) keeps the rule outcome.
    ``error``/``timed_out`` of the rule outcome are kept.
    """
    if mode not in ("tinyv_only", "addon", "mixed"):
        raise ValueError(f"TinyV mode must be tinyv_only, addon or mixed, got {mode!r}")
    out = []
    for rule, v in zip(rule_outcomes, verdicts, strict=True):
        if v is None:
            out.append(rule)
            continue
        v = float(v)
        positive = v >= 0.5
        if mode == "tinyv_only":
            out.append(dataclasses.replace(rule, score=v, correct=positive))
        elif mode == "addon":
            if rule.correct:
                out.append(rule)
            else:
                out.append(dataclasses.replace(rule, score=max(rule.score, weight * v), correct=positive))
        else:
            out.append(dataclasses.replace(rule, score=(1 - weight) * rule.score + weight * v,
                                           correct=rule.correct or positive))
    return out


def verifier_prompt(request: ScoreRequest, cfg: TinyVConfig) -> str:
    """What the verifier is asked about ``request`` (``extra_info["question"]``, "" if absent): TinyV's
    equivalence question on its final answer, or the RRM's grading of the full response by its rubric."""
    question = str(request.extra_info.get("question", ""))
    if cfg.verifier == "tinyv":
        return PROMPT.format(question=question, reference=request.ground_truth, answer=final_answer(request.response))
    where = f"sample {request.sample_id or '?'} (data_source {request.data_source!r})"
    return (cfg.rrm_template or RRM_PROMPT).format(
        question=question, criteria=rubric_criteria(request.extra_info, where), solution=request.response)


_KIND_CHECKED: set[tuple[str, str]] = set()  # (base_url, verifier) whose first replies were read
_KIND_PARSERS = {"tinyv": parse_verdict, "rrm": parse_rrm_score}


def check_verifier_kind(replies: Sequence[Reply], cfg: TinyVConfig) -> None:
    """Read the first replies a server gives (once per ``base_url`` and kind in this process) and refuse,
    with ``ValueError`` naming ``reward.tinyv.verifier``, a server that is not of the configured kind:

    - ``tinyv``: none of the replies holds a True/False verdict (a rubric reward model writes grading
      prose; whatever the model, every sample would score as no verdict);
    - ``rrm``: none holds a grade and every reply is a bare True/False (a TinyV model).  Other
      ungraded replies keep the fallback (a weak rubric model is the fallback's business).
    """
    texts = [r.text for r in replies if r.text is not None]
    key = (cfg.base_url, cfg.verifier)
    if key in _KIND_CHECKED or not texts:
        return
    _KIND_CHECKED.add(key)
    if any(r.value is not None for r in replies):
        return
    if cfg.verifier == "tinyv":
        grading = any(re.search(r"score|criteri|points?\b|grade", t, re.IGNORECASE) for t in texts)
        hint = ("they read as a rubric reward model's grading: set reward.tinyv.verifier=rrm" if grading
                else "check reward.tinyv.verifier, reward.tinyv.model and the served model")
        raise ValueError(f"reward.tinyv.verifier=tinyv: none of the first {len(texts)} replies of the verifier at "
                         f"{cfg.base_url} is a True/False verdict (first: {texts[0][:80]!r}); {hint}")
    if all(re.fullmatch(r"\W*(?:true|false)\W*", t, re.IGNORECASE) for t in texts):
        raise ValueError(f"reward.tinyv.verifier=rrm: none of the first {len(texts)} replies of the verifier at "
                         f"{cfg.base_url} is a Total Score grade, each is a True/False verdict "
                         f"(first: {texts[0][:80]!r}): a TinyV model; set reward.tinyv.verifier=tinyv")


def apply_tinyv(requests: Sequence[ScoreRequest], rule_outcomes: Sequence[ScoreOutcome],
                cfg: TinyVConfig) -> tuple[list[ScoreOutcome], dict[str, int]]:
    """Rescore a batch with the verifier: every request is taken as TinyV-routed (the caller picks
    them).

    Returns the outcomes, in order, and counts: ``asked`` (requests sent to the verifier),
    ``upgraded`` (asked, wrong by the rule, positive by the verifier), ``fallbacks`` (asked, no verdict)
    and ``timeouts`` (the fallbacks whose request timed out).
    """
    asked = [i for i, o in enumerate(rule_outcomes) if needs_verdict(o, cfg.mode)]
    parse = _KIND_PARSERS[cfg.verifier]
    replies = VerifierClient.from_config(cfg).ask_batch([verifier_prompt(requests[i], cfg) for i in asked], parse)
    check_verifier_kind(replies, cfg)
    no_verdict = None if cfg.fallback == "rule" else 0.0  # "zero": as if the verifier said False / graded 0
    verdicts: list[bool | float | None] = [None] * len(requests)
    for i, r in zip(asked, replies, strict=True):
        verdicts[i] = no_verdict if r.value is None else r.value
    outcomes = tinyv_scores(rule_outcomes, verdicts, cfg.mode, cfg.weight)
    what = "kept the rule outcome" if cfg.fallback == "rule" else "scored as a verdict of 0"
    for i, r in zip(asked, replies, strict=True):
        if r.value is None:
            prefix = TIMEOUT_ERROR if r.timed_out else FALLBACK_ERROR
            error = f"{prefix}: the verifier gave no verdict ({r.error}); {what}"
            outcomes[i] = dataclasses.replace(outcomes[i], error="; ".join(e for e in (outcomes[i].error, error) if e))
    missing = [r for r in replies if r.value is None]
    stats = {"asked": len(asked), "fallbacks": len(missing), "timeouts": sum(r.timed_out for r in missing),
             "upgraded": sum(r.value is not None and r.value >= 0.5 and not rule_outcomes[i].correct
                             for i, r in zip(asked, replies, strict=True))}
    if missing:
        log.warning("TinyV: %d of %d asked samples fell back (%d timed out; fallback=%s)", len(missing), len(asked),
                    stats["timeouts"], cfg.fallback)
    return outcomes, stats
