"""Parallel, timeout-safe reward scoring: ``score_all(requests, scorer, workers, timeout)``.

Contract: one ``ScoreOutcome`` per ``ScoreRequest``, in request order, and never an exception from
the scorer.  A scorer that raises gives score 0 with ``error = "ExcType: message"``; a sample not
scored within ``timeout`` seconds gives score 0 with ``timed_out`` set; a worker process that dies
mid-sample (segfault, out of memory) gives score 0 with a ``WorkerDied`` error.  The scorer must be
picklable for ``workers >= 1``: a module-level function such as ``compute_score``, or the
``CustomScorer`` / ``CustomRewards`` of ``megareason.rewards.custom``.

Design (``workers >= 1``): ``ScorePool`` starts ``workers`` processes (``spawn`` context: no forked
CUDA or thread state, the same on every platform), each joined to the parent by its own pipe and
scoring ONE request at a time.  The parent sends a request to each idle worker, stamps a deadline
``now + timeout`` and waits on all pipes at once (``multiprocessing.connection.wait``) until the
next result or the earliest deadline.  A worker past its deadline is SIGKILLed -- the only thing
that stops sympy stuck inside one C-level big-integer operation -- its sample is marked timed out,
and a fresh worker is started in its place while the others keep scoring.  The clock starts when
the request is sent to an idle, started worker, so queueing and start-up never count towards a
sample's timeout.  Workers run the scorer in their main thread, so math-verify's own SIGALRM
timeouts (5 s per step in the math reward) still apply inside them.  As with any ``spawn`` pool, a
script that scores with ``workers >= 1`` needs an ``if __name__ == "__main__":`` guard.
(``ProcessPoolExecutor`` cannot kill one hung task, and
``multiprocessing.Pool.apply_async(...).get(timeout)`` counts time spent queued and must throw
away every other in-flight task when it terminates the pool.)

``workers = 0`` scores in this process and does NOT enforce ``timeout``: a SIGALRM of our own would
clash with math-verify's own alarms, and no signal interrupts a C-level operation, so only a
separate process can be killed safely.  (The math reward still applies math-verify's own timeouts
when called from the main thread.)
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from megareason.rewards.custom import Scorer
from megareason.rewards.registry import compute_score

log = logging.getLogger(__name__)

_READY = "ready"  # a worker's first message: started, scorer unpickled
_MAX_LOG_LINES = 3  # per score_all call, then one summary line with the counts
_START_TIMEOUT_S = 120.0  # spawn + imports (sympy) take ~1 s; far longer means a broken environment


@dataclass(frozen=True)
class ScoreRequest:
    """One response to score; the first four fields are the scorer's arguments, and ``prompt`` (the
    chat messages, when given) its ``prompt`` keyword.

    ``sample_id`` is a free-form label used only in log lines (default: the request's position).
    """

    data_source: str
    response: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    sample_id: str = ""
    prompt: list[dict] | None = None
    chat: bool = False  # the row gave its prompt as chat messages (``PromptRecord.chat``)


@dataclass(frozen=True)
class ScoreOutcome:
    """The reward of one request.

    ``score``/``correct`` as in ``RewardOutput`` (0.0/False on any failure); ``error`` is
    ``"ExcType: message"`` when scoring failed (empty otherwise, also set on a timeout);
    ``timed_out`` says the sample was not scored within the timeout and its worker was killed;
    ``parts`` as in ``RewardOutput``.
    """

    score: float
    correct: bool
    error: str = ""
    timed_out: bool = False
    parts: tuple[tuple[str, float], ...] = ()


def score_one(scorer: Scorer, request: ScoreRequest) -> ScoreOutcome:
    """``scorer`` on one request, in this process; an exception becomes an ``error`` outcome."""
    try:
        kwargs = {"prompt": request.prompt} if request.prompt is not None else {}
        out = scorer(request.data_source, request.response, request.ground_truth, request.extra_info, **kwargs)
        return ScoreOutcome(score=float(out.score), correct=bool(out.correct), parts=tuple(out.parts))
    except Exception as e:  # a broken scorer must not lose the batch; the error is reported instead
        return ScoreOutcome(score=0.0, correct=False, error=f"{type(e).__name__}: {e}")


def _worker_main(conn: Connection, scorer: Scorer) -> None:
    """Worker loop: announce readiness, then score each request received until ``None`` or EOF."""
    # Ctrl-C and SIGTERM are the parent's to handle (Slurm signals every process of the driver's step on
    # pre-emption: the driver finishes its step, scored here, then checkpoints); the parent kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send(_READY)
    try:
        while (request := conn.recv()) is not None:
            conn.send(score_one(scorer, request))
    except EOFError:  # the parent went away
        pass


class _Worker:
    """One worker process, its pipe, and the request index it is scoring (None when idle)."""

    def __init__(self, ctx: mp.context.BaseContext, scorer: Scorer, clock: Callable[[], float]):
        self.clock = clock
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child_conn, scorer), name="reward-worker", daemon=True)
        self.proc.start()
        child_conn.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = clock() + _START_TIMEOUT_S  # until ready; then per request

    def start_task(self, index: int, request: ScoreRequest, timeout: float) -> None:
        self.conn.send(request)
        self.task, self.deadline = index, self.clock() + timeout

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


class ScorePool:
    """``workers`` reward processes kept alive across ``score`` calls (see the module docstring).

    Use as a context manager, or call ``close``; ``score_all`` wraps one pool per call.
    """

    def __init__(self, scorer: Scorer = compute_score, workers: int = 1, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        """``clock``: the seconds deadlines are stamped and checked in (a test passes a stand-in that
        advances only while every busy worker is one it knows hangs, so that no other sample's timing
        depends on how busy the machine is)."""
        _check_args(workers, timeout)
        if workers < 1:
            raise ValueError(f"ScorePool needs workers >= 1, got {workers}; use score_all(workers=0) in-process")
        self.scorer, self.timeout, self.clock = scorer, float(timeout), clock
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, scorer, clock) for _ in range(workers)]

    def __enter__(self) -> ScorePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker: ask politely, then kill whatever has not exited within a second."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:  # already dead or closed
                pass
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            w.kill()
        self._workers = []

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutcome]:
        """Outcomes of ``requests`` in order; on an exception here (e.g. Ctrl-C) the pool is closed."""
        if not self._workers:
            raise ValueError("ScorePool is closed")
        try:
            outcomes = self._run(requests)
        except BaseException:
            self.close()  # workers may hold stale requests; never reuse them
            raise
        _log_failures(requests, outcomes, self.timeout)
        return outcomes

    def _run(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutcome]:
        outcomes: list[ScoreOutcome | None] = [None] * len(requests)
        queue = deque(range(len(requests)))
        while queue or any(w.task is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    i = queue.popleft()
                    try:
                        w.start_task(i, requests[i], self.timeout)
                    except OSError:  # it died while idle: not this request's fault, so retry it
                        queue.appendleft(i)
                        self._replace(w)
            waiting = [w for w in self._workers if not w.ready or w.task is not None]
            next_deadline = min(w.deadline for w in waiting)
            wait_s = None if math.isinf(next_deadline) else max(0.0, next_deadline - self.clock())
            readable = wait([w.conn for w in waiting], wait_s)
            now = self.clock()
            for w in waiting:
                if w.conn in readable:
                    self._receive(w, outcomes)
                elif now >= w.deadline and w.task is None:
                    raise RuntimeError(f"reward worker did not start within {_START_TIMEOUT_S:g}s")
                elif now >= w.deadline:
                    outcomes[w.task] = ScoreOutcome(
                        score=0.0, correct=False, timed_out=True,
                        error=f"TimeoutError: not scored within {self.timeout:g}s; worker killed")
                    self._replace(w)
        assert all(o is not None for o in outcomes)
        return outcomes

    def _receive(self, w: _Worker, outcomes: list[ScoreOutcome | None]) -> None:
        """Take one message from ``w``: its start-up signal, a result, or EOF (it died)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join()
            if w.task is None:
                raise RuntimeError(f"reward worker exited during start-up (exit code {w.proc.exitcode}); "
                                   "its traceback is above") from None
            outcomes[w.task] = ScoreOutcome(
                score=0.0, correct=False, error=f"WorkerDied: reward worker exited with code {w.proc.exitcode}")
            self._replace(w)
            return
        if isinstance(msg, str):
            assert msg == _READY, msg
            w.ready, w.deadline = True, math.inf
        else:
            outcomes[w.task] = msg
            w.task, w.deadline = None, math.inf

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` and start a fresh worker in its slot."""
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.scorer, self.clock)


def _check_args(workers: int, timeout: float) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an integer >= 0 (0 = in-process), got {workers!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")


def _log_failures(requests: Sequence[ScoreRequest], outcomes: Sequence[ScoreOutcome], timeout: float) -> None:
    """A warning per failed sample, at most ``_MAX_LOG_LINES``, then one line with the counts."""
    failed = [(i, o) for i, o in enumerate(outcomes) if o.error]
    for i, o in failed[:_MAX_LOG_LINES]:
        label = requests[i].sample_id or f"#{i}"
        what = f"timed out after {timeout:g}s" if o.timed_out else f"failed: {o.error[:200]}"
        log.warning("reward for sample %s (data_source %r) %s", label, requests[i].data_source, what)
    if failed:
        timed_out = sum(o.timed_out for _, o in failed)
        log.warning("reward scoring: %d of %d samples failed (%d timed out, %d raised or lost their worker)",
                    len(failed), len(outcomes), timed_out, len(failed) - timed_out)


def score_all(requests: Sequence[ScoreRequest], scorer: Scorer = compute_score, workers: int = 0,
              timeout: float = 10.0) -> list[ScoreOutcome]:
    """Score ``requests`` in order with ``scorer``; see the module docstring for the contract.

    ``workers = 0`` scores in this process (``timeout`` validated but not enforced); ``workers >= 1``
    uses a ``ScorePool`` of ``min(workers, len(requests))`` processes, closed before returning.
    Raises ``ValueError`` naming the argument for ``workers < 0`` or ``timeout <= 0``.
    """
    _check_args(workers, timeout)
    if workers == 0:
        outcomes = [score_one(scorer, r) for r in requests]
        _log_failures(requests, outcomes, timeout)
        return outcomes
    if not requests:
        return []
    with ScorePool(scorer, min(workers, len(requests)), timeout) as pool:
        return pool.score(requests)
