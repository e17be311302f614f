"""The golden-curve comparison (tests/golden_curves.py) on hand-made rows: what it lets through across CPU
kinds, and what it still refuses."""

from __future__ import annotations

import copy
import json

import golden_curves
import pytest
from golden_curves import HORIZON_ACROSS_CPU_KINDS, check_golden, golden


def test_on_the_recording_cpu_kind_every_step_counts(monkeypatch):
    monkeypatch.setattr(golden_curves, "recorded_here", lambda: True)
    want = golden("ppo")
    check_golden("ppo", copy.deepcopy(want))
    later = copy.deepcopy(want)
    later[max(want)]["val/reward"] += 0.003  # past the horizon, which applies only across CPU kinds
    with pytest.raises(AssertionError, match=f"ppo.jsonl step {max(want)}: .*val/reward"):
        check_golden("ppo", later)


def test_the_cpu_kind_is_the_model_and_pytorchs_vector_width(monkeypatch, tmp_path):
    monkeypatch.setattr(golden_curves, "CPU_KIND", tmp_path / "cpu_kind.json")
    assert not golden_curves.recorded_here()  # nothing recorded: compared as across kinds
    kind = golden_curves.cpu_kind()
    assert kind["capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "SVE256")
    golden_curves.CPU_KIND.write_text(json.dumps(kind))
    assert golden_curves.recorded_here()
    golden_curves.CPU_KIND.write_text(json.dumps({**kind, "capability": "AVX2" if kind["capability"] != "AVX2"
                                                  else "AVX512"}))
    assert not golden_curves.recorded_here()


def test_ppo_is_compared_exactly_up_to_its_horizon_and_by_its_metric_names_after_it(monkeypatch):
    monkeypatch.setattr(golden_curves, "recorded_here", lambda: False)  # another CPU kind
    want = golden("ppo")
    horizon = HORIZON_ACROSS_CPU_KINDS["ppo"]
    assert horizon < max(want)
    check_golden("ppo", copy.deepcopy(want))
    # past the horizon: a greedy answer of another token changes val/reward, and the float sums drift
    later = copy.deepcopy(want)
    later[max(want)]["val/reward"] += 0.003
    later[horizon + 1]["actor/grad_norm"] *= 1.0058  # the AVX2-only EPYC's step 5
    check_golden("ppo", later)
    # within it: a sampled token's reward, or a grad norm beyond ACROSS_CPU_KINDS, is a failure
    for key, change in (("reward/mean", lambda v: v + 1 / 64), ("actor/grad_norm", lambda v: v * 1.003)):
        bad = copy.deepcopy(want)
        bad[horizon][key] = change(bad[horizon][key])
        with pytest.raises(AssertionError, match=f"ppo.jsonl step {horizon}: .*{key}"):
            check_golden("ppo", bad)
    # past it: a metric gone, or a step missing
    gone = copy.deepcopy(want)
    del gone[max(want)]["val/reward"]
    with pytest.raises(AssertionError, match=f"step {max(want)}: other metrics"):
        check_golden("ppo", gone)
    with pytest.raises(AssertionError, match="steps"):
        check_golden("ppo", {s: r for s, r in want.items() if s != max(want)})
