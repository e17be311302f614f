"""The start-up table of a run's data: one line per data source (rows, where they come from, the reward
that scores them and how it is called, the validation rows, the system message added), how validation
was chosen, and the first prompt as the model sees it. ``megareason train`` prints it before Ray starts
and writes it into the run folder (``data.txt``), so a run that trains on the wrong prompts or scores
them with the wrong reward says so before its first step.
"""

from __future__ import annotations

from collections import Counter

from megareason.data.loaders import LoadedData
from megareason.rewards.custom import Scorer
from megareason.rewards.scoring import describe_reward

TABLE_FILE = "data.txt"  # in the run folder
_HEADER = ("source", "from", "rows", "data_source", "reward (how it is called)", "val rows", "system prompt added")


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def data_table(data: LoadedData, scorer: Scorer, first_prompt: str) -> str:
    """The table (module docstring) of ``data`` scored by ``scorer``; ``first_prompt``: the first training
    prompt after the chat template."""
    val_counts = Counter(r.data_source for r in data.val)
    rows = []
    trained = {id(r) for r in data.train}  # without the rows held out for validation (data.val_size)
    for src in data.sources:
        # one line per data_source, and per prompt format where a TRL function gets them differently
        counts = Counter((r.data_source, r.chat) for r in src.records if id(r) in trained)
        system = repr(_short(src.system_prompt)) if src.system_prompt else "none"
        for (name, chat), n in counts.items():
            rows.append((src.where, src.origin, str(n), name, describe_reward(scorer, name, chat),
                         str(val_counts.get(name, 0)), system))
    for name in sorted(set(val_counts) - {r[3] for r in rows}):  # validation rows of a source not trained on
        rows.append(("data.val_sources", "", "0", name, describe_reward(scorer, name, False), str(val_counts[name]),
                     ""))
    widths = [max(len(r[i]) for r in [_HEADER, *rows]) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [_HEADER, *rows]]
    systems = {s.system_prompt for s in data.sources + data.val_sources if s.system_prompt}
    added = "; ".join(repr(s) for s in sorted(systems)) if systems else "none: the rows go in as written"
    return "\n".join([
        f"data: {len(data.train)} training rows from {len(data.sources)} source(s)",
        *("  " + line for line in lines),
        f"validation: {data.val_note}",
        f"system message added to rows without one: {added}",
        "first prompt as the model sees it:",
        *("  | " + line for line in first_prompt.splitlines()),
    ])
