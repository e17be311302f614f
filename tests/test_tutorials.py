"""docs/from_verl.md and docs/from_trl.md, run as written: each ```python title=FILE block is written to FILE,
each ```bash command runs (``python`` as a subprocess; ``megareason train`` in process with the tiny model in
place of the Hub model, up to the start of Ray), and the table each train command prints and writes into its
run folder is the ```text block the page shows after it (up to the rendered prompt, which is the chat
template's). The training steps on the tiny model are test_train_e2e.py's run on verl and TRL rows."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```(\w+)(?: title=(\S+))?\n(.*?)^```$", re.S | re.M)
# The tiny model answers within these (the page's own settings are the recipe's).
_TINY = ["trainer.prompts_per_step=2", "rollout.max_tokens=16", "rollout.max_model_len=512",
         "data.max_prompt_length=256", "trainer.micro_batch_tokens=512"]


def _blocks(page: str) -> list[tuple[str, str, str]]:
    """(language, title, text) of every fenced block of ``page``, in order."""
    return [(m.group(1), m.group(2) or "", m.group(3)) for m in _BLOCK.finditer((REPO / page).read_text())]


def _commands(text: str) -> list[list[str]]:
    return [shlex.split(c) for c in text.replace("\\\n", " ").splitlines() if c.strip()]


class _RayStarted(BaseException):  # not an Exception: the CLI reports those once a run's log exists
    pass


def _squeezed(lines: list[str]) -> list[str]:
    return [" ".join(line.split()) for line in lines]


@pytest.mark.parametrize("page", ["docs/from_verl.md", "docs/from_trl.md"])
def test_every_command_of_the_tutorial_runs_as_written(page, tiny_qwen2, tmp_path, monkeypatch, capsys):
    from megareason.cli import main
    from megareason.launch import reaper
    from megareason.trainer import loop

    def ray(*args, **kwargs):
        raise _RayStarted

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop, "ray_session", ray)
    monkeypatch.setattr(reaper, "reap_descendants_on_exit", lambda: None)
    monkeypatch.setenv("MEGAREASON_VERBOSE", "1")
    blocks = _blocks(page)
    trained = []
    for i, (lang, title, text) in enumerate(blocks):
        if lang == "python" and title:
            (tmp_path / title).write_text(text)
        if lang != "bash":
            continue
        for args in _commands(text):
            if args[0] == "python":
                proc = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True, timeout=120)
                assert proc.returncode == 0, proc.stderr
                continue
            assert args[:2] == ["megareason", "train"], args
            overrides = [f"model.path={tiny_qwen2}" if a.startswith("model.path=") else a for a in args[2:]]
            out = Path(next(a for a in overrides if a.startswith("trainer.output_dir=")).split("=", 1)[1])
            with pytest.raises(_RayStarted):  # every check passed; the workers would start now
                main(["train", *overrides, *_TINY])
            table = (tmp_path / out / "data.txt").read_text().splitlines()
            shown = next((t for lang2, _, t in blocks[i + 1:] if lang2 == "text"), None)
            if shown is not None and shown not in [t for _, _, t in blocks[:i]]:
                assert _squeezed(shown.splitlines()) == _squeezed(table[: len(shown.splitlines())]), table
            trained.append(table)
    capsys.readouterr()
    assert len(trained) == {"docs/from_verl.md": 2, "docs/from_trl.md": 1}[page]
