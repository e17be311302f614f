"""Folders megareason writes whole (convert's exports, checkpoints, a run's step checkpoints, the model cache)
go to a new or empty folder or replace an earlier one of their own kind, atomically; a folder holding
anything else is refused, naming it and a few of its entries, and nothing in it is touched. In process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megareason.models.checkpoint import CHECKPOINT
from megareason.models.convert import write_hf, write_peft
from megareason.trainer.run_dir import RunDir, TrainerState
from megareason.utils import OccupiedFolder, check_replaceable


def _users(folder: Path, n: int = 1) -> Path:
    """``folder`` as a user's: their files (and a folder of theirs) in it."""
    (folder / "projects").mkdir(parents=True)
    for i in range(n):
        (folder / f"notes_{i}.txt").write_text("mine")
    return folder


def _config_dir(tmp_path: Path) -> Path:
    hf = tmp_path / "source_hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return hf


def test_an_hf_export_refuses_a_users_folder_and_replaces_an_earlier_export(tmp_path):
    users = _users(tmp_path / "models", n=6)
    with pytest.raises(OccupiedFolder) as refused:
        write_hf({"w": torch.ones(2)}, _config_dir(tmp_path), users)
    message = str(refused.value)
    assert str(users) in message and "notes_0.txt, notes_1.txt" in message and "and 2 more" in message, message
    assert sorted(os.listdir(users)) == [f"notes_{i}.txt" for i in range(6)] + ["projects"]
    assert sorted(os.listdir(tmp_path)) == ["models", "source_hf"]  # no temporary folder left beside it

    export = tmp_path / "export"
    write_hf({"w": torch.zeros(2)}, tmp_path / "source_hf", export)
    write_hf({"w": torch.ones(2)}, tmp_path / "source_hf", export)
    assert load_file(export / "model.safetensors")["w"].tolist() == [1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["export", "models", "source_hf"]
    empty = tmp_path / "empty"
    empty.mkdir()
    write_hf({"w": torch.ones(2)}, tmp_path / "source_hf", empty)
    assert sorted(os.listdir(empty)) == ["config.json", "model.safetensors"]


def test_an_export_with_a_users_file_added_or_of_another_kind_is_not_replaced(tmp_path):
    export, adapter = tmp_path / "export", tmp_path / "adapter"
    write_hf({"w": torch.ones(2)}, _config_dir(tmp_path), export)
    write_peft({"a": torch.ones(2)}, {"r": 4}, adapter)
    write_peft({"a": torch.zeros(2)}, {"r": 4}, adapter)  # an earlier adapter is replaced
    assert load_file(adapter / "adapter_model.safetensors")["a"].tolist() == [0.0, 0.0]
    with pytest.raises(OccupiedFolder, match="adapter_config.json, adapter_model.safetensors"):
        write_hf({"w": torch.ones(2)}, tmp_path / "source_hf", adapter)
    with pytest.raises(OccupiedFolder, match="config.json, model.safetensors"):
        write_peft({"a": torch.ones(2)}, {"r": 4}, export)
    (export / "README.md").write_text("my notes on this model")
    with pytest.raises(OccupiedFolder, match=r"it holds README\.md\)"):
        write_hf({"w": torch.zeros(2)}, tmp_path / "source_hf", export)
    assert load_file(export / "model.safetensors")["w"].tolist() == [1.0, 1.0]
    (tmp_path / "a_file").write_text("x")
    os.symlink(export, tmp_path / "a_link")
    for target in ("a_file", "a_link"):
        with pytest.raises(OccupiedFolder, match="is (not a folder|a symbolic link)"):
            write_hf({"w": torch.zeros(2)}, tmp_path / "source_hf", tmp_path / target)
    assert (tmp_path / "a_file").read_text() == "x" and (export / "README.md").is_file()


def test_a_checkpoint_replaces_an_earlier_checkpoint_only(tmp_path):
    earlier = tmp_path / "ckpt"
    (earlier / "hf").mkdir(parents=True)
    for name in ("megareason.json", ".metadata", "common.pt", "metadata.json", "__0_0.distcp", "__1_0.distcp"):
        (earlier / name).write_text("")
    check_replaceable(earlier, CHECKPOINT)
    check_replaceable(tmp_path / "new", CHECKPOINT)
    with pytest.raises(OccupiedFolder, match=r"notes_0\.txt, projects"):
        check_replaceable(_users(tmp_path / "home"), CHECKPOINT)
    (earlier / "notes.txt").write_text("mine")
    with pytest.raises(OccupiedFolder, match=r"it holds notes\.txt\)"):
        check_replaceable(earlier, CHECKPOINT)


def test_the_cli_refuses_to_convert_into_a_users_folder(tiny_qwen2, tmp_path, capsys, monkeypatch):
    from megareason.cli import main
    from megareason.models import convert

    def converted(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(convert, "hf_to_megatron", converted)
    monkeypatch.setattr(convert, "megatron_to_hf", converted)

    users = _users(tmp_path / "models")
    ckpt = tmp_path / "ckpt"  # enough of a checkpoint for the checks before the conversion
    ckpt.mkdir()
    (ckpt / "megareason.json").write_text(json.dumps({"arch": {}}))
    for argv in (["hf-to-megatron", str(tiny_qwen2)], ["megatron-to-hf", str(ckpt)],
                 ["megatron-to-hf", str(ckpt), "--peft"]):
        assert main(["convert", argv[0], argv[1], str(users), *argv[2:]]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: output folder {users} is neither empty nor an earlier "), err
        assert "notes_0.txt, projects" in err and err.count("\n") == 1
    assert sorted(os.listdir(users)) == ["notes_0.txt", "projects"]
    assert (users / "notes_0.txt").read_text() == "mine"


def test_a_step_checkpoint_replaces_an_earlier_one_never_a_folder_of_someone_elses(tmp_path):
    run = RunDir(tmp_path)
    tmp = run.begin_checkpoint(2)
    (tmp / "actor").mkdir()
    run.commit_checkpoint(tmp, TrainerState(step=2), keep_last=2)
    tmp = run.begin_checkpoint(2)  # the same step again (a run restarted from step 0)
    (tmp / "actor").mkdir()
    (tmp / "rollout_inflight.pt").write_text("")
    run.commit_checkpoint(tmp, TrainerState(step=2), keep_last=2)
    assert (run.checkpoint(2) / "rollout_inflight.pt").is_file()
    assert sorted(os.listdir(run.checkpoints)) == ["step_00000002"]
    _users(run.checkpoint(4))
    tmp = run.begin_checkpoint(4)
    with pytest.raises(OccupiedFolder, match=r"step_00000004 is neither empty .*notes_0\.txt, projects"):
        run.commit_checkpoint(tmp, TrainerState(step=4), keep_last=2)
    assert sorted(os.listdir(run.checkpoint(4))) == ["notes_0.txt", "projects"]


def _save_into(model_dir: str, *outs: str) -> list[str]:
    """A checkpoint saved from every rank into each of ``outs`` in turn; what each save got on this rank:
    "saved" or the refusal."""
    from megareason.models.build import HFCheckpoint, build_gpt
    from megareason.models.checkpoint import save_checkpoint
    from megareason.models.parallel import init_parallel

    init_parallel(1, 1)
    ckpt = HFCheckpoint(model_dir)
    model, got = build_gpt(ckpt.arch), []
    for out in outs:
        try:
            save_checkpoint(out, model, ckpt.arch, model_dir)
            got.append("saved")
        except OccupiedFolder as e:
            got.append(str(e))
    return got


def test_every_rank_refuses_a_checkpoint_into_a_users_folder_and_an_earlier_one_is_replaced(tiny_qwen2, tmp_path):
    from distributed import run_workers

    users, ckpt = _users(tmp_path / "home"), tmp_path / "ckpt"
    for refused, first, again in run_workers(2, _save_into, str(tiny_qwen2), str(users), str(ckpt), str(ckpt)):
        assert "home is neither empty nor an earlier megareason checkpoint" in refused, refused
        assert "notes_0.txt, projects" in refused and first == again == "saved"
    assert sorted(os.listdir(users)) == ["notes_0.txt", "projects"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "home"]  # no temporary folder left


def test_a_run_writes_only_into_a_new_or_empty_folder_or_a_run_folder(tmp_path):
    from megareason.trainer.run_dir import check_run_folder, hold_run_lock

    users = _users(tmp_path / "home", n=2)
    with pytest.raises(OccupiedFolder, match=r"trainer.output_dir .*home is neither empty nor a run folder \(it "
                                             r"holds notes_0\.txt, notes_1\.txt, projects\)"):
        hold_run_lock(users)
    assert sorted(os.listdir(users)) == ["notes_0.txt", "notes_1.txt", "projects"]  # no .lock taken there
    (users / "config.json").write_text("{}")  # a user's config.json is not a run's
    with pytest.raises(OccupiedFolder):
        check_run_folder(users)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OccupiedFolder, match="is not a folder"):
        check_run_folder(tmp_path / "a_file")
    empty = tmp_path / "empty"
    empty.mkdir()
    for ok in (tmp_path / "new", empty):
        check_run_folder(ok)
    for mark in (".lock", "metrics.jsonl", "ray_logs"):  # a run's, an older run's, its Slurm job's
        run = tmp_path / f"run{mark}"
        run.mkdir()
        (run / mark).write_text("")
        (run / "notes.txt").write_text("mine, added to my run folder")
        check_run_folder(run)
    snapshot = tmp_path / "snapshot"  # a Slurm job's first start: its code snapshot only (slurm/ray_cluster.sh)
    (snapshot / "code" / "c-7").mkdir(parents=True)
    with pytest.raises(OccupiedFolder):  # a folder named code alone is not a run's
        check_run_folder(snapshot)
    (snapshot / "code" / "c-7" / ".megareason-code").write_text("/checkout abc clean\n")
    check_run_folder(snapshot)
    resumable = tmp_path / "resumable"  # a complete checkpoint makes a run folder too
    run = RunDir(resumable)
    tmp = run.begin_checkpoint(2)
    run.commit_checkpoint(tmp, TrainerState(step=2), keep_last=2)
    check_run_folder(resumable)
    hold_run_lock(resumable)
    assert (resumable / ".lock").is_file()


def test_the_cli_refuses_to_train_into_a_users_folder(tiny_qwen2, tmp_path, capsys, monkeypatch):
    from megareason.cli import main
    from megareason.launch import reaper
    from megareason.trainer import loop, sft

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(reaper, "reap_descendants_on_exit", lambda: None)  # nothing to reap in this process
    monkeypatch.setattr(loop, "train", started)
    monkeypatch.setattr(sft, "sft", started)
    monkeypatch.setenv("MEGAREASON_VERBOSE", "1")  # the console as it is: no log file in the folder
    users = _users(tmp_path / "home")
    for command in ("train", "sft"):
        assert main([command, f"model.path={tiny_qwen2}", f"trainer.output_dir={users}"]) == 2
        err = capsys.readouterr().err
        assert f"error: trainer.output_dir {users} is neither empty nor a run folder" in err, err
    assert sorted(os.listdir(users)) == ["notes_0.txt", "projects"]


def test_a_benchmark_refuses_a_users_folder_under_a_combinations_name_before_any_engine(tmp_path, monkeypatch):
    from megareason.config import load_config
    from megareason.evaluation import benchmark
    from megareason.rollout import engine

    def started(*args, **kwargs):
        raise AssertionError("an engine started")

    monkeypatch.setattr(engine, "VLLMEngine", started)
    out = tmp_path / "bench"
    cfg = load_config("eval_multihop", [f"benchmark.output_dir={out}", "benchmark.models=[my_model]",
                                        "benchmark.retrievers=[bm25]"])
    users = _users(out / benchmark.run_name("my_model", "bm25"))
    with pytest.raises(OccupiedFolder, match=r"my_model__bm25 is neither empty nor an earlier benchmark result "
                                             r"folder \(it holds notes_0\.txt, projects\)"):
        benchmark.run_benchmark(cfg)
    assert sorted(os.listdir(users)) == ["notes_0.txt", "projects"]
    earlier = out / benchmark.run_name("my_model", "golden")  # an unfinished combination of its own is rewritten
    earlier.mkdir()
    (earlier / "samples.jsonl").write_text("")
    check_replaceable(earlier, benchmark.BENCHMARK_RUN)


def test_fetching_a_model_refuses_a_users_folder_in_the_cache_before_converting(tmp_path, monkeypatch):
    from megareason.models import hub

    def converted(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setenv("MEGAREASON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "_gguf_path", converted)
    name = sorted(hub.KNOWN_MODELS)[0]
    users = _users(hub.model_dir(name))
    with pytest.raises(OccupiedFolder, match=r"notes_0\.txt, projects"):
        hub.fetch(name, force=True)
    assert sorted(os.listdir(users)) == ["notes_0.txt", "projects"]
