"""tools/bench_verifier.py without a verifier: the pairs file's parsing (a bad row names its line and
field), the shipped pairs file's shape, and the rates and records computed from hand-made outcomes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megareason.config.schema import TinyVConfig
from megareason.rewards.pool import ScoreOutcome

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_verifier.py"
HEADER = "# kind, expected, question, reference, answer\n\n"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_verifier", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bv = _tool()


def _write(tmp_path, *rows: str) -> Path:
    path = tmp_path / "pairs.tsv"
    path.write_text(HEADER + "".join(r + "\n" for r in rows), encoding="utf-8")
    return path


def test_load_pairs_reads_rows_and_skips_comments(tmp_path):
    path = _write(tmp_path, "units\t1\tHow long?\t150\t150 \\text{ cm}", "# a comment", "",
                  "percent\t0\tWhat percent?\t25\\%\t0.25\\%")
    assert bv.load_pairs(path) == [
        bv.Pair("units", True, "How long?", "150", "150 \\text{ cm}", 3),
        bv.Pair("percent", False, "What percent?", "25\\%", "0.25\\%", 6),
    ]


@pytest.mark.parametrize(("row", "message"), [
    ("units\t1\tHow long?\t150", r"pairs.tsv:4: 4 tab-separated fields, need 5 \(kind, expected, question, "
                                 r"reference, answer\)"),
    ("units\tyes\tHow long?\t150\t150", r"pairs.tsv:4: field 'expected' must be 1 \(equivalent\) or 0 \(wrong\), "
                                        r"got 'yes'"),
    ("units\t1\tHow long?\t150\t ", r"pairs.tsv:4: field 'answer' is empty"),
    ("\t1\tHow long?\t150\t150", r"pairs.tsv:4: field 'kind' is empty"),
])
def test_load_pairs_names_the_line_and_field_of_a_bad_row(tmp_path, row, message):
    path = _write(tmp_path, "units\t1\tHow long?\t150\t150 \\text{ cm}", row)
    with pytest.raises(ValueError, match=message):
        bv.load_pairs(path)


def test_load_pairs_refuses_a_file_without_pairs(tmp_path):
    with pytest.raises(ValueError, match="no pairs"):
        bv.load_pairs(_write(tmp_path))


def test_shipped_pairs_file_has_200_pairs_balanced_per_kind():
    pairs = bv.load_pairs(bv.PAIRS)
    assert len(pairs) >= 200
    assert len({(p.reference, p.answer) for p in pairs}) == len(pairs)  # no pair twice
    for kind in {p.kind for p in pairs}:
        of_kind = [p for p in pairs if p.kind == kind]
        assert sum(p.expected for p in of_kind) * 2 == len(of_kind), kind


def _pair(kind: str, expected: bool, line: int):
    return bv.Pair(kind, expected, "q", "r", "a", line)


def test_outcomes_and_rates_from_hand_made_outcomes():
    # (kind, expected, rule correct, rule + verifier correct, fell back): addon asks where the rule says wrong.
    cases = [
        ("units", True, True, True, False),     # rule right: not asked
        ("units", True, False, True, False),    # rescued by the verifier
        ("units", False, False, False, False),  # rejected by both (verifier said False)
        ("units", False, False, True, False),   # let through by the verifier
        ("labelled", True, False, False, True),  # no verdict: scored 0 (fallback zero)
        ("labelled", False, True, True, False),  # the rule's own mistake: not asked
    ]
    pairs = [_pair(k, e, i + 1) for i, (k, e, *_rest) in enumerate(cases)]
    rule = [ScoreOutcome(float(r), r) for _, _, r, _, _ in cases]
    fallback = f"{bv.FALLBACK_ERROR}: the verifier gave no verdict (timed out); scored as a verdict of 0"
    addon = [ScoreOutcome(float(a), a, fallback if fb else "") for _, _, _, a, fb in cases]
    outcomes = bv.outcomes_of(pairs, rule, addon)
    assert [(o.asked, o.verdict) for o in outcomes] == [
        (False, None), (True, True), (True, False), (True, True), (True, None), (False, None)]

    by_kind = bv.rates(outcomes)
    assert list(by_kind) == ["units", "labelled", bv.ALL]
    assert by_kind["units"] == bv.Rates(equivalent=2, wrong=2, rule_accepted=1, rule_rejected=2, addon_accepted=2,
                                        addon_rejected=1, calls=3, fallbacks=0)
    assert by_kind["labelled"] == bv.Rates(equivalent=1, wrong=1, rule_accepted=0, rule_rejected=0,
                                           addon_accepted=0, addon_rejected=0, calls=1, fallbacks=1)
    assert by_kind[bv.ALL] == bv.Rates(equivalent=3, wrong=3, rule_accepted=1, rule_rejected=2, addon_accepted=2,
                                       addon_rejected=1, calls=4, fallbacks=1)
    assert bv.flips(outcomes) == (1, 1)
    assert bv.Rates.share(2, 3) == pytest.approx(2 / 3)

    cost = bv.Cost(calls=4, concurrency=8, wall_s=2.0, warmup_s=1.0, prompt_tokens=1000, completion_tokens=8)
    text = bv.summary(outcomes, cost, command="python tools/bench_verifier.py", machine="2 CPU cores",
                      model="m", date="2026-01-01", pairs_path="p.tsv", jsonl_name="o.jsonl",
                      cfg=TinyVConfig(mode="addon"))
    assert "| units | 2/2 | 50.0% (1/2) | 100.0% (2/2) | 100.0% (2/2) | 50.0% (1/2) | 3 | 0 |" in text
    assert "| **all** | 3/3 | 33.3% (1/3) | 66.7% (2/3) | 66.7% (2/3) | 33.3% (1/3) | 4 | 1 |" in text
    assert "answered True to 2 of its 4 calls" in text
    assert "0.500 s per asked sample" in text and "250 prompt + 2.0 completion" in text


def test_jsonl_has_one_record_per_pair(tmp_path):
    pairs = [_pair("units", True, 1)]
    outcomes = bv.outcomes_of(pairs, [ScoreOutcome(0.0, False)], [ScoreOutcome(1.0, True)])
    bv.write_outputs(outcomes, "# summary\n", tmp_path / "o.jsonl", tmp_path / "o.md")
    [record] = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert record == {"kind": "units", "expected": True, "question": "q", "reference": "r", "answer": "a", "line": 1,
                      "rule": False, "asked": True, "verdict": True, "addon": True, "error": ""}
