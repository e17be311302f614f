"""A rerun resumes its run folder's latest checkpoint only with the run's own config: the fields a resume
may change (``run_dir.RESUMABLE_CHANGES``: more steps, a copied run folder, save and log settings) may
differ, any other difference is refused naming each field with its old and new value, before anything is
loaded and without touching config.json, unless ``trainer.resume_mode=force``. In process: a role that
writes its checkpoint as a file stands for the model workers; no Ray, no vLLM."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from megareason.config import ConfigError, load_config
from megareason.trainer.driver import Driver
from megareason.trainer.run_dir import _UNSET, RunDir, config_changes

BASE = ["trainer.save_every=2", "trainer.steps=2", "trainer.val_before_train=false"]


class _Role:
    """A trained role whose checkpoint is one file naming its step."""

    name, loaded = "actor", ""

    def save(self, path: str, meta: dict) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "model.pt").write_text(f"weights of step {meta['step']}")

    def load(self, path: str) -> None:
        self.loaded = (Path(path) / "model.pt").read_text()

    def sync_weights(self) -> None:
        pass


def _cfg(out: Path, *extra: str):
    return load_config("grpo_smollm2_cpu", [f"trainer.output_dir={out}", *BASE, *extra])


def _run(out: Path, *extra: str) -> _Role:
    """Start (or resume) a run in ``out`` and train it to the end; the role, to see what it loaded."""
    role = _Role()
    driver = Driver(_cfg(out, *extra), RunDir(out), [role], 16, "training", None)
    driver.start()
    for step, _ in driver.steps():
        driver.end_step(step, {"loss": float(step)})
    driver.close()
    return role


def test_the_same_config_and_more_steps_resume(tmp_path):
    _run(tmp_path)
    assert _run(tmp_path).loaded == "weights of step 2"  # nothing left to train: it resumes at the end
    role = _run(tmp_path, "trainer.steps=4", "trainer.keep_last=3", "trainer.loggers=[console]")
    assert role.loaded == "weights of step 2" and RunDir(tmp_path).steps() == [2, 4]
    assert json.loads((tmp_path / "config.json").read_text())["trainer"]["steps"] == 4


def test_a_copied_run_folder_resumes(tmp_path):
    import shutil

    _run(tmp_path / "straight")
    shutil.copytree(tmp_path / "straight", tmp_path / "copy")
    assert _run(tmp_path / "copy", "trainer.steps=4").loaded == "weights of step 2"


def test_a_changed_learning_rate_is_refused_naming_it_and_config_json_is_kept(tmp_path):
    _run(tmp_path)
    saved = (tmp_path / "config.json").read_bytes()
    role = _Role()
    driver = Driver(_cfg(tmp_path, "optim.lr=1e-3", "rollout.n=8", "trainer.steps=4"), RunDir(tmp_path), [role], 16,
                    "training", None)
    with pytest.raises(ConfigError) as refused:
        driver.start()
    message = str(refused.value)
    assert "optim.lr: 1e-05 -> 0.001" in message and "rollout.n: 4 -> 8" in message, message
    assert "trainer.steps" not in message and "trainer.resume_mode=force" in message and str(tmp_path) in message
    assert role.loaded == "" and (tmp_path / "config.json").read_bytes() == saved


def test_force_resumes_with_the_changes_and_records_them(tmp_path, caplog):
    _run(tmp_path)
    role = _run(tmp_path, "optim.lr=1e-3", "trainer.steps=4", "trainer.resume_mode=force")
    assert role.loaded == "weights of step 2" and RunDir(tmp_path).steps() == [2, 4]
    assert "optim.lr: 1e-05 -> 0.001" in caplog.text
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 1e-3


def test_disable_and_a_folder_without_checkpoints_start_fresh_whatever_the_config(tmp_path):
    _run(tmp_path)
    assert _run(tmp_path, "optim.lr=1e-3", "trainer.resume_mode=disable").loaded == ""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text(json.dumps(asdict(_cfg(fresh))))  # a run stopped before its first save
    assert RunDir(fresh).check_resume(_cfg(fresh, "optim.lr=1e-3")) == []


def test_differences_are_dotted_keys_list_items_included_and_resumable_fields_ignored():
    old = asdict(load_config("grpo_smollm2_cpu"))
    new = json.loads(json.dumps(old))
    new["data"]["sources"][0]["size"] += 1
    new["data"]["sources"][0]["options"]["extra"] = 1
    new["trainer"]["steps"] += 10
    new["trainer"]["output_dir"] = "elsewhere"
    new["parallel"]["data_parallel_size"] = 2  # checkpoints reshard on load
    size = old["data"]["sources"][0]["size"]
    assert config_changes(old, new) == [("data.sources[0].options.extra", _UNSET, 1),
                                        ("data.sources[0].size", size, size + 1)]


def test_a_config_json_of_an_older_version_compares_by_this_versions_fields(tmp_path):
    """Fields the saved config lacks take their defaults, fields this version no longer has are dropped."""
    cfg = _cfg(tmp_path)
    _run(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["trainer"]["max_staleness"]
    raw["trainer"]["retired_setting"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert RunDir(tmp_path).check_resume(cfg) == []
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read as this version's config"):
        RunDir(tmp_path).check_resume(cfg)


def _prior_run(out: Path, model: Path) -> list[str]:
    """A run folder as a finished run leaves it (config.json and a step-2 checkpoint), and the overrides
    that made it: what ``megareason train`` and ``sft`` read before starting anything."""
    overrides = [f"model.path={model}", f"trainer.output_dir={out}", *BASE]
    step = out / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 2, "sampler": {"epoch": 0, "position": 16}}))
    (out / "config.json").write_text(json.dumps(asdict(load_config("grpo_smollm2_cpu", overrides))))
    return overrides


def _nothing_starts(monkeypatch) -> None:
    """Data, reward workers, Ray and worker groups fail the test if anything reaches them."""
    from megareason.trainer import handles, loop, sft

    def started(*args, **kwargs):
        raise AssertionError("something started before the config was checked")

    for module in (loop, sft):
        for name in ("ray_session", "scoring_pool", "load_data"):
            monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(handles, "WorkerGroup", started)


def test_train_and_sft_refuse_a_changed_config_before_ray_or_any_worker(tiny_qwen2, tmp_path, monkeypatch):
    from megareason.trainer import loop, sft

    _nothing_starts(monkeypatch)
    overrides = _prior_run(tmp_path / "run", tiny_qwen2)
    saved = (tmp_path / "run" / "config.json").read_bytes()
    with pytest.raises(ConfigError, match=r"optim\.lr: 1e-05 -> 0\.01"):
        loop.train(load_config("grpo_smollm2_cpu", [*overrides, "optim.lr=1e-2"]))
    with pytest.raises(ConfigError, match=r"optim\.lr: 1e-05 -> 0\.01"):
        sft.sft(load_config("grpo_smollm2_cpu", [*overrides, "optim.lr=1e-2"]))
    assert (tmp_path / "run" / "config.json").read_bytes() == saved


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_cli_exits_2_naming_the_changed_field(command, tiny_qwen2, tmp_path, monkeypatch, capsys):
    from megareason.cli import main
    from megareason.launch import reaper

    monkeypatch.setattr(reaper, "reap_descendants_on_exit", lambda: None)  # nothing to reap in this process
    _nothing_starts(monkeypatch)
    monkeypatch.setenv("MEGAREASON_VERBOSE", "1")  # the console as it is: no log file in the run folder
    overrides = _prior_run(tmp_path / "run", tiny_qwen2)
    saved = (tmp_path / "run" / "config.json").read_bytes()
    assert main([command, "--config-name", "grpo_smollm2_cpu", *overrides, "optim.lr=1e-2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'run'} holds a run to resume") and "optim.lr: 1e-05 -> 0.01" in err
    assert (tmp_path / "run" / "config.json").read_bytes() == saved
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", "checkpoints", "config.json"]


class _Clock:
    """``time`` for the driver: steps and saves take the seconds the test says."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_a_deadline_saves_and_stops_after_the_last_step_that_leaves_room_for_another_and_a_save(
        tmp_path, monkeypatch, caplog):
    """Steps of 100 s, checkpoints of 50 s (every 3 steps), the job ending 1,000 s after the start, a margin of
    120 s. By hand: step 6 and its checkpoint end at 6 x 100 + 2 x 50 = 700 s; step 7 ends at 800 s with
    200 s left < 100 + 50 + 120: the run saves step 7 and stops (exit 75), well before the end; run again
    with a later end, it resumes at step 8 and finishes."""
    import megareason.trainer.driver as driver_module

    clock = _Clock()
    monkeypatch.setattr(driver_module, "time", clock)

    class TimedRole(_Role):
        def save(self, path, meta):
            clock.now += 50
            super().save(path, meta)

    def run(end_in_s: float, *extra: str) -> TimedRole:
        monkeypatch.setenv("MEGAREASON_JOB_END_TIME", str(clock.now + end_in_s))
        role = TimedRole()
        driver = Driver(_cfg(tmp_path, "trainer.steps=12", "trainer.save_every=3", "trainer.stop_margin_s=120",
                             *extra), RunDir(tmp_path), [role], 16, "training", None)
        driver.start()
        for step, _ in driver.steps():
            clock.now += 100
            driver.end_step(step, {"loss": float(step)})
        driver.close()
        return role

    start = clock.now
    with pytest.raises(SystemExit) as stopped:
        run(1000)
    assert stopped.value.code == 75 and RunDir(tmp_path).steps() == [6, 7]
    assert clock.now - start == 850  # step 7's checkpoint done 150 s before the job's end
    assert "the deadline is 200 s away, less than a step (100 s), a checkpoint (50 s)" in caplog.text
    assert "stopped after step 7 with a checkpoint" in caplog.text
    role = run(10_000)  # the requeued job: time enough for the rest
    assert role.loaded == "weights of step 7" and RunDir(tmp_path).steps()[-1] == 12
    # trainer.must_save_by_minutes alone (no Slurm end time): the same rule, from the run's start.
    monkeypatch.delenv("MEGAREASON_JOB_END_TIME")
    other = tmp_path / "minutes"
    driver = Driver(_cfg(other, "trainer.steps=12", "trainer.save_every=0", "trainer.stop_margin_s=0",
                         "trainer.must_save_by_minutes=4.5"), RunDir(other), [TimedRole()], 16, "training", None)
    driver.start()
    with pytest.raises(SystemExit):
        for step, _ in driver.steps():
            clock.now += 100
            driver.end_step(step, {"loss": float(step)})
    assert RunDir(other).steps() == [2]  # after step 2: 70 s left < a step of 100 s (no save measured yet)
