"""The reward pool: same outcomes as in-process scoring, in order; timeouts, errors and dead workers
cost only their own sample; bad arguments raise ``ValueError`` naming the argument."""

import logging
import os
import time

import pytest

from megareason.rewards import RewardOutput, compute_score
from megareason.rewards.custom import load_custom
from megareason.rewards.pool import ScoreOutcome, ScorePool, ScoreRequest, score_all

# (data_source, response, ground_truth): right, wrong, unboxed, LaTeX-equivalent and malformed answers.
SAMPLES = [
    ("math", r"so the answer is \boxed{\frac{1}{2}}", "0.5"),
    ("math", r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}"),
    ("math", r"\boxed{0.75}", r"\frac34"),
    ("math", r"\boxed{\frac{2}{3}}", r"\frac{3}{2}"),
    ("math", r"first \boxed{1} then \boxed{2}", "2"),
    ("math", r"first \boxed{2} then \boxed{1}", "2"),
    ("math", "the answer is 7", "7"),
    ("math", r"\boxed{x^2 + 2x + 1}", "(x+1)^2"),
    ("math", r"\boxed{\{1, 2, 3\}}", r"\{3, 2, 1\}"),
    ("math", r"\boxed{[0, 1)}", "[0,1)"),
    ("math", r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
    ("math", r"\boxed{\sqrt{8}}", r"3\sqrt{2}"),
    ("math", r"\boxed{90^\circ}", "90"),
    ("math", r"\boxed{\text{(B)}}", "(B)"),
    ("math", r"\fbox{ -5 }", "-5"),
    ("math", r"\boxed{4} then \boxed{5", "4"),
    ("champ", r"\boxed{\pi}", r"\pi"),
    ("competition_math", r"\boxed{e^{i\pi}}", "-1"),
    ("gsm8k", "She pays 3 * 4 = 12 dollars.\n#### 12", "12"),
    ("gsm8k", "#### 1,000", "1000"),
    ("gsm8k", "#### 72.0", "72"),
    ("gsm8k", "The answer is 12", "12"),
    ("gsm8k", "#### 13", "12"),
    ("gsm8k_flexible", "so it costs $18.", "18"),
    ("gsm8k_flexible", "no digits here", "18"),
    ("arithmetic", "2 + 5 = 7", "7"),
    ("arithmetic", r"\boxed{-3}", "-3.0"),
    ("arithmetic", r"\boxed{3/4}", "0.75"),
    ("arithmetic", "2 + 5 = 8", "7"),
    ("arithmetic", "I think it is 7", "7"),
    ("chain_sum", "1 + 2 + 3 = 6.", "6"),
    ("basic_arithmetic", r"\boxed{10}", "12"),
]


def _requests(samples=SAMPLES) -> list[ScoreRequest]:
    return [ScoreRequest(src, resp, gold, {}, f"s{i}") for i, (src, resp, gold) in enumerate(samples)]


def faulty_scorer(data_source: str, response: str, ground_truth: str, extra_info: dict) -> RewardOutput:
    """``compute_score``, except: "hang" sleeps forever, "raise" raises, "die" kills its process."""
    if response == "hang":
        time.sleep(3600)
    if response == "raise":
        raise KeyError("boom")
    if response == "die":
        os._exit(3)
    return compute_score(data_source, response, ground_truth, extra_info)


def test_pool_matches_in_process_scoring_in_order():
    requests = _requests()
    expected = [compute_score(r.data_source, r.response, r.ground_truth, r.extra_info) for r in requests]
    assert 0 < sum(e.correct for e in expected) < len(expected)  # the samples exercise both outcomes
    want = [ScoreOutcome(score=e.score, correct=e.correct) for e in expected]
    assert score_all(requests, workers=0) == want
    assert score_all(requests, workers=2, timeout=30.0) == want


class HangClock:
    """A stand-in for the pool's clock: time stands still while any worker scores a sample that is not a
    "hang", and jumps to the earliest deadline once every busy worker holds one. So only the hangs time out,
    however long the machine takes to score the others (a loaded machine took > 1 s for one math sample)."""

    def __init__(self, requests: list[ScoreRequest]):
        self.requests, self.pool, self.now = requests, None, 0.0

    def __call__(self) -> float:
        busy = [w for w in (self.pool._workers if self.pool else []) if w.task is not None]
        if busy and all(self.requests[w.task].response == "hang" for w in busy):
            self.now = max(self.now, min(w.deadline for w in busy))
        return self.now


def test_hang_raise_and_death_cost_only_their_own_sample(caplog):
    good = _requests(SAMPLES[:6])
    bad = [ScoreRequest("math", text, "1", sample_id=f"bad-{text}") for text in ("hang", "raise", "die", "hang")]
    requests = good[:2] + bad[:2] + good[2:4] + bad[2:] + good[4:]
    want_good = score_all(good, workers=0)

    clock = HangClock(requests)
    with ScorePool(faulty_scorer, workers=2, timeout=1.0, clock=clock) as pool:
        clock.pool = pool
        with caplog.at_level(logging.WARNING, logger="megareason.rewards.pool"):
            out = pool.score(requests)
        elapsed = clock.now
        clock.requests = good
        again = pool.score(good)  # the replaced workers still serve later calls

    assert [out[i] for i in (0, 1, 4, 5, 8, 9)] == want_good == again
    hang, raised, died, hang2 = out[2], out[3], out[6], out[7]
    for o in (hang, hang2):
        assert (o.score, o.correct, o.timed_out) == (0.0, False, True)
        assert o.error.startswith("TimeoutError: not scored within 1s")
    assert raised == ScoreOutcome(score=0.0, correct=False, error="KeyError: 'boom'")
    assert (died.score, died.timed_out) == (0.0, False) and died.error == "WorkerDied: reward worker exited with code 3"
    # each hang was cut at its 1 s deadline, not an hour; the second hang started while the first waited,
    # so the clock passed one or two timeouts in all
    assert elapsed in (1.0, 2.0)
    assert "sample bad-hang" in caplog.text and "4 of 10 samples failed (2 timed out" in caplog.text
    assert len(caplog.records) == 4  # 3 sample lines at most, then the counts


def test_custom_scorer_pickles_into_workers(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(data_source, response, ground_truth, extra_info):\n"
                 "    return float(response == ground_truth)\n")
    scorer = load_custom(f"{f}:score")
    requests = [ScoreRequest("any", "a", "a"), ScoreRequest("any", "a", "b")]
    assert score_all(requests, scorer=scorer, workers=1) == [ScoreOutcome(1.0, True), ScoreOutcome(0.0, False)]


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"workers": -1}, "workers"), ({"workers": 1.5}, "workers"),
    ({"timeout": 0}, "timeout"), ({"timeout": -2.0}, "timeout"), ({"timeout": float("nan")}, "timeout"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        score_all(_requests()[:1], **kwargs)
    with pytest.raises(ValueError, match=f"^{name} must be"):
        ScorePool(**{"workers": 1, **kwargs})


def test_empty_requests_start_no_workers():
    assert score_all([], workers=4) == []
