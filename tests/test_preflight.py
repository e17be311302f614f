"""Inputs checked before any engine or worker starts (megareason/launch/preflight.py, models/hf_check.py):
copies of the tiny model truncated, padded or corrupted by hand, hand-written index and config files, and
the CLI run as a user runs it, which must print one line per problem and exit 2 without starting anything.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from megareason.config import load_config
from megareason.data import DataError
from megareason.launch.preflight import PreflightError, check_data_file, check_run, check_writable
from megareason.models.arch import ArchError
from megareason.models.hf_check import CheckpointError, check_hf_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def model(tiny_qwen2, tmp_path) -> Path:
    """A private copy of the tiny Qwen2 checkpoint, free to break."""
    return Path(shutil.copytree(tiny_qwen2, tmp_path / "model"))


def test_valid_model_passes(model):
    check_hf_dir(model, megatron=True)
    check_hf_dir(model, megatron=False)


def test_truncated_file_names_both_sizes(model):
    st = model / "model.safetensors"
    size = st.stat().st_size  # as saved by transformers: exactly what its header describes
    os.truncate(st, size - 1000)
    with pytest.raises(CheckpointError) as e:
        check_hf_dir(model)
    assert str(e.value) == f"model file {st} is truncated: its header says {size:,} bytes, the file has {size - 1000:,}"


def test_truncated_inside_the_header_and_before_the_length(model):
    st = model / "model.safetensors"
    os.truncate(st, 100)
    with pytest.raises(CheckpointError, match=rf"^model file {st} is truncated: its JSON header alone is [0-9,]+ "
                       "bytes, the file has 100$"):
        check_hf_dir(model)
    os.truncate(st, 5)
    with pytest.raises(CheckpointError, match=rf"^model file {st} is truncated: the file has 5 bytes, not even"):
        check_hf_dir(model)


def test_extra_bytes_after_the_tensors(model):
    st = model / "model.safetensors"
    size = st.stat().st_size
    with st.open("ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"^model file {st} has 16 bytes after its last tensor: its header says "
                       rf"{size:,} bytes, the file has {size + 16:,}$"):
        check_hf_dir(model)


def test_garbled_header(model):
    st = model / "model.safetensors"
    raw = bytearray(st.read_bytes())
    raw[8:12] = b"\xff\xfe!!"  # the JSON header starts at byte 8
    st.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"^model file {st} has an unreadable header"):
        check_hf_dir(model)


def _write_by_hand(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_hand_written_headers(tmp_path):
    from megareason.models.hf_check import safetensors_header

    good = tmp_path / "good.safetensors"
    _write_by_hand(good, {"__metadata__": {"format": "pt"},
                          "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                          "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}, bytes(32))
    assert sorted(safetensors_header(good)) == ["a", "b"]
    assert sorted(safetensors_header(good)) == sorted(load_file(good))  # safetensors agrees it is valid
    wrong_size = tmp_path / "size.safetensors"  # 2 x 3 float32 is 24 bytes, not 20
    _write_by_hand(wrong_size, {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(20))
    with pytest.raises(CheckpointError, match=r"tensor 'a' \(F32, shape \[2, 3\]\) needs 24 bytes, its data_offsets "
                       "give 20"):
        safetensors_header(wrong_size)
    gap = tmp_path / "gap.safetensors"
    _write_by_hand(gap, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                         "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}, bytes(12))
    with pytest.raises(CheckpointError, match=r"tensor 'b' occupies bytes \[8, 12\), expected to start at 4"):
        safetensors_header(gap)


def _shard(model: Path) -> dict[str, str]:
    """Split the copy's model.safetensors into two shards with an index written by hand."""
    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    half = {n: ("model-00001-of-00002.safetensors" if i < len(names) // 2 else "model-00002-of-00002.safetensors")
            for i, n in enumerate(names)}
    for file in set(half.values()):
        save_file({n: tensors[n] for n in names if half[n] == file}, model / file)
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": half}))
    return half


def test_sharded_checkpoint_and_its_index(model):
    half = _shard(model)
    check_hf_dir(model, megatron=True)
    index = model / "model.safetensors.index.json"
    name = next(n for n, f in half.items() if f.startswith("model-00002"))
    index.write_text(json.dumps({"weight_map": {**half, "lm_head.extra": half[name]}}))
    with pytest.raises(CheckpointError, match=rf"^model index {index} puts tensor 'lm_head.extra' in "
                       r"model-00002-of-00002.safetensors, which does not hold it$"):
        check_hf_dir(model)
    index.write_text(json.dumps({"weight_map": half}))
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"^model index {index} names model-00002-of-00002.safetensors, "
                       "which is missing$"):
        check_hf_dir(model)
    index.write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=rf"^model index {index} is not valid JSON"):
        check_hf_dir(model)


def test_missing_tensor_for_megatron(model):
    st = model / "model.safetensors"
    tensors = load_file(st)
    del tensors["model.norm.weight"]
    save_file(tensors, st)
    check_hf_dir(model)  # vLLM decides for itself
    with pytest.raises(CheckpointError, match=rf"^model directory {model} is missing 1 tensors: model.norm.weight$"):
        check_hf_dir(model, megatron=True)


def test_qwen3_for_megatron(tiny_qwen3, tmp_path):
    """Qwen3 passes; its per-head norms are tensors the Megatron build needs; a sliding-window variant is
    refused by name before any weight is read."""
    model = Path(shutil.copytree(tiny_qwen3, tmp_path / "qwen3"))
    check_hf_dir(model, megatron=True)
    st, config = model / "model.safetensors", model / "config.json"
    tensors = load_file(st)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, st)
    with pytest.raises(CheckpointError, match=r"is missing 1 tensors: model.layers.1.self_attn.k_norm.weight$"):
        check_hf_dir(model, megatron=True)
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_sliding_window": True}))
    with pytest.raises(ArchError, match=rf"^{config}: use_sliding_window=true \(sliding-window attention layers\)"):
        check_hf_dir(model, megatron=True)


def test_no_weights(model):
    (model / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"^model directory {model} has no weights"):
        check_hf_dir(model)


def test_config_json(model):
    config = model / "config.json"
    good = json.loads(config.read_text())
    config.write_text(json.dumps({**good, "model_type": "gpt2"}))
    check_hf_dir(model)  # vLLM serves more architectures than the Megatron build
    with pytest.raises(ArchError, match=rf"^{config}: unsupported architecture model_type='gpt2'"):
        check_hf_dir(model, megatron=True)
    config.write_text(json.dumps({k: v for k, v in good.items() if k != "num_attention_heads"}))
    with pytest.raises(ArchError, match=rf"^model config {config} lacks 'num_attention_heads'$"):
        check_hf_dir(model, megatron=True)
    config.write_text(json.dumps(good)[:-20])
    with pytest.raises(CheckpointError, match=rf"^model config {config} is not valid JSON: .* \(line 1, column"):
        check_hf_dir(model)


def test_tokenizer_files(model):
    tok = model / "tokenizer.json"
    tok.write_text(tok.read_text()[:500])
    with pytest.raises(CheckpointError, match=rf"^tokenizer file {tok} is not valid JSON"):
        check_hf_dir(model)
    check_hf_dir(model, tokenizer=False)
    tok.unlink()
    with pytest.raises(CheckpointError, match=rf"^tokenizer folder {model} has no tokenizer"):
        check_hf_dir(model)


def test_output_folder(tmp_path):
    new = tmp_path / "a" / "b"
    check_writable(new, "eval.output_dir")
    assert not (tmp_path / "a").exists() and os.listdir(tmp_path) == []  # nothing created, probe removed
    (tmp_path / "f").write_text("")
    with pytest.raises(PreflightError, match=rf"^output folder {tmp_path / 'f' / 'out'} cannot be created: "
                       rf"{tmp_path / 'f'} is a file \(trainer.output_dir\)$"):
        check_writable(tmp_path / "f" / "out", "trainer.output_dir")


def test_read_only_output_folder():
    """sysfs refuses new files to every user, root included (a chmod 555 folder would not stop root)."""
    ro = Path("/sys/kernel")
    with pytest.raises(PreflightError, match=rf"^output folder {ro / 'megareason_run'} is not writable \(it would be "
                       rf"created in {ro}\): Permission denied"):
        check_writable(ro / "megareason_run", "eval.output_dir")


def test_data_files(tmp_path):
    with pytest.raises(DataError, match=rf"^data file {tmp_path / 'x.jsonl'} does not exist "
                       r"\(data.sources\[1\].path\)$"):
        check_data_file(str(tmp_path / "x.jsonl"), "data.sources[1].path")
    with pytest.raises(DataError, match=rf"^data file {tmp_path} is not a file"):
        check_data_file(str(tmp_path), "data.sources[0].path")
    with pytest.raises(DataError, match=r"^data.sources\[0\].path is empty"):
        check_data_file("", "data.sources[0].path")


def test_every_problem_at_once_and_known_names_resolved(model, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAREASON_CACHE", str(tmp_path / "cache"))
    cached = Path(shutil.copytree(model, tmp_path / "cache" / "models" / "smollm2-135m-instruct"))
    check_run(load_config("eval", [f"eval.output_dir={tmp_path / 'out'}"]), "eval")  # the built-in name
    os.truncate(cached / "model.safetensors", 10_000)
    cfg = load_config("grpo_smollm2_cpu", [f"trainer.output_dir={tmp_path / 'run'}",
                                           f"data.sources=[{{kind: file, path: {tmp_path / 'no.jsonl'}}}]"])
    with pytest.raises(PreflightError) as e:
        check_run(cfg, "train")
    assert [p.split(" is truncated")[0] if "truncated" in p else p for p in e.value.problems] == [
        f"model file {cached / 'model.safetensors'}",
        f"data file {tmp_path / 'no.jsonl'} does not exist (data.sources[0].path)",
    ]


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEGAREASON_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "megareason.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "vLLM" not in proc.stderr and "Ray" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()


def test_cli_refuses_a_truncated_model_before_starting_anything(model, tmp_path):
    st = model / "model.safetensors"
    os.truncate(st, st.stat().st_size // 2)
    line = f"error: model file {st} is truncated: its header says"
    missing = tmp_path / "missing.jsonl"
    data = f"data.sources=[{{kind: file, path: {missing}}}]"

    (err,) = _errors(_cli(tmp_path, "eval", f"model.path={model}", f"eval.output_dir={tmp_path / 'eval'}"))
    assert err.startswith(line)
    train = _errors(_cli(tmp_path, "train", f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}", data))
    assert train[0].startswith(line)
    assert train[1:] == [f"error: data file {missing} does not exist (data.sources[0].path)"]
    (err,) = _errors(_cli(tmp_path, "sft", f"model.path={model}", f"trainer.output_dir={tmp_path / 'sft'}"))
    assert err.startswith(line)
    bench = _errors(_cli(tmp_path, "benchmark", f"benchmark.models=[{model}, no-such-model]",
                         f"benchmark.output_dir={tmp_path / 'bench'}"))
    assert bench[0].startswith(line) and bench[1].startswith("error: model.path 'no-such-model' is neither")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no output folder, log or lock was made


def test_convert_refuses_a_truncated_model(model, tmp_path, capsys):
    from megareason.cli import main

    st = model / "model.safetensors"
    os.truncate(st, st.stat().st_size - 4)
    assert main(["convert", "hf-to-megatron", str(model), str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.startswith(f"error: model file {st} is truncated: its header says")
    assert main(["convert", "megatron-to-hf", str(model), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: checkpoint {model} is not a megareason checkpoint (no megareason.json)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# ----------------------------------------------------------------------------------------- room for checkpoints


def _free(monkeypatch, free: int) -> list[Path]:
    """shutil.disk_usage answers ``free`` bytes; returns the paths it was asked about."""
    asked = []

    def usage(path):
        asked.append(Path(path))
        return shutil._ntuple_diskusage(10**15, 10**15 - free, free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return asked


def _ckpt_bytes(model: Path, cfg) -> float:
    from megareason.launch.plan_memory import total_params
    from megareason.launch.preemption import checkpoint_bytes, trainable_params
    from megareason.models.arch import ModelArch

    arch = ModelArch.from_pretrained(model)
    return checkpoint_bytes(cfg, total_params(arch), trainable_params(cfg, arch))


def test_checkpoints_to_fit_count_the_kept_ones_the_one_being_written_and_those_there():
    from megareason.launch.preflight import checkpoints_to_fit

    def fit(existing=0, **trainer):
        keys = {"steps": 100, "save_every": 10, "keep_last": 2, **trainer}
        return checkpoints_to_fit(load_config("grpo_smollm2_cpu", [f"trainer.{k}={v}" for k, v in keys.items()]),
                                  existing)

    assert fit() == 3  # keep_last + 1 being written
    assert fit(keep_last=5) == 6 and fit(existing=1) == 2 and fit(existing=2) == 1
    assert fit(existing=7) == 1  # more than keep_last there (a lower keep_last now): one more, then deleted
    assert fit(save_every=0) == 1 and fit(steps=2) == 1 and fit(steps=20) == 2  # saves: every 10 steps and the last
    assert fit(steps=2, save_every_minutes=30) == 3  # as many saves as time allows


def test_an_output_folder_without_room_for_the_checkpoints_is_refused_naming_both_sizes(model, tmp_path, monkeypatch):
    from megareason.launch.preflight import check_checkpoint_space

    out = tmp_path / "runs" / "new"
    cfg = load_config("grpo_smollm2_cpu", [f"model.path={model}", f"trainer.output_dir={out}", "trainer.keep_last=2"])
    each = _ckpt_bytes(model, cfg)
    asked = _free(monkeypatch, int(3 * each))
    check_checkpoint_space(cfg)  # exactly room for two kept and one being written
    assert asked == [tmp_path]  # the nearest existing ancestor
    _free(monkeypatch, int(3 * each) - 1)
    with pytest.raises(PreflightError) as e:
        check_checkpoint_space(cfg)
    (problem,) = e.value.problems
    assert problem.startswith(f"output folder {out} has {(3 * each - 1) / 1e6:,.1f} MB free on its file system "
                              f"({tmp_path}); the run needs {3 * each / 1e6:,.1f} MB: 3 more checkpoint(s) of "
                              f"{each / 1e6:,.1f} MB (")
    assert "fp32 weights + Adam state), as it keeps trainer.keep_last=2 plus one being written;" in problem
    assert problem.endswith("(trainer.output_dir)")
    # bf16: 2 bytes a weight + 12 of Adam state (fp32 main weights, two moments), against fp32's 4 + 8
    bf16 = load_config("grpo_smollm2_cpu", ["trainer.precision=bf16"])
    assert _ckpt_bytes(model, bf16) == pytest.approx(14 / 12 * each)
    # PPO saves its critic too
    assert _ckpt_bytes(model, load_config("ppo_smollm2_cpu")) == pytest.approx(2 * each)


def test_a_resumed_run_needs_room_only_beside_its_checkpoints(model, tmp_path, monkeypatch):
    from megareason.launch.preflight import check_checkpoint_space

    out = tmp_path / "run"
    for step in (10, 20):
        (out / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    cfg = load_config("grpo_smollm2_cpu", [f"model.path={model}", f"trainer.output_dir={out}"])
    each = _ckpt_bytes(model, cfg)
    asked = _free(monkeypatch, int(each))
    check_checkpoint_space(cfg)
    assert asked == [out]
    _free(monkeypatch, int(each) - 1)
    with pytest.raises(PreflightError, match=r"1 more checkpoint\(s\) .* one being written, 2 of them there already"):
        check_checkpoint_space(cfg)


def test_lora_checkpoints_hold_the_adam_state_of_the_adapters_only(model):
    cfg = load_config("grpo_smollm2_cpu")
    lora = load_config("grpo_smollm2_cpu", ["lora.enabled=true", "lora.rank=4"])
    assert _ckpt_bytes(model, lora) < 0.5 * _ckpt_bytes(model, cfg)


def test_train_preflight_reports_the_space_with_the_other_problems(model, tmp_path, monkeypatch):
    _free(monkeypatch, 0)
    missing = tmp_path / "no.jsonl"
    cfg = load_config("grpo_smollm2_cpu", [f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}",
                                           f"data.sources=[{{kind: file, path: {missing}}}]"])
    with pytest.raises(PreflightError) as e:
        check_run(cfg, "train")
    assert e.value.problems[0] == f"data file {missing} does not exist (data.sources[0].path)"
    assert e.value.problems[1].startswith(f"output folder {tmp_path / 'run'} has 0.0 MB free")
    check_run(load_config("eval", [f"model.path={model}", f"eval.output_dir={tmp_path / 'eval'}"]), "eval")  # no saves
    cfg = load_config("grpo_smollm2_cpu", [f"model.path={tmp_path / 'nothing'}",
                                           f"trainer.output_dir={tmp_path / 'run2'}"])
    with pytest.raises(PreflightError) as e:  # no config.json: reported once, by the model's check
        check_run(cfg, "train")
    assert len(e.value.problems) == 1 and "free" not in e.value.problems[0]
    # a node whose RAM (pages x page size) cannot hold the run's host memory, beside the other problems
    _free(monkeypatch, 10**15)
    monkeypatch.setattr("megareason.launch.preflight.os.sysconf", lambda name: 1)
    cfg = load_config("grpo_smollm2_cpu", [f"model.path={model}", f"trainer.output_dir={tmp_path / 'run3'}",
                                           f"data.sources=[{{kind: file, path: {missing}}}]"])
    with pytest.raises(PreflightError) as e:
        check_run(cfg, "train")
    assert e.value.problems[1].startswith("host memory: the run's ") and "on a node of 1 ranks" in e.value.problems[1]
    assert "this node has 0.0 MB" in e.value.problems[1] and e.value.problems[1].endswith("(no gather over DP)")


def test_host_memory_per_node_counts_the_checkpoint_gather_and_the_offload_copies_and_refuses_beyond_ram():
    """Qwen3-8B's recipe (TP 2 x DP 4, bf16, distributed optimizer, trainer.offload_optimizer) on a node of 8
    ranks: its peak is the save, where each rank holds, in host memory, the pinned copies of its fp32 main
    weights and Adam moments (the caching host allocator keeps them after they come back), vLLM's level-1 sleep
    copy of its weights, and megatron-core's fully_reshardable gather of its whole gradient buffer's three fp32
    states (12 B a parameter), its own shards (12 B / DP) and one state's DP shards received and concatenated
    (8 B). By hand from the parameter count of one rank (n) and vLLM's shard (the model over TP 2)."""
    from megareason.launch.plan_memory import stage_params, total_params
    from megareason.launch.plan_records import MODEL_SHAPES
    from megareason.launch.preflight import check_host_memory, host_memory_per_node

    cfg = load_config("grpo_qwen3_8b")
    arch = MODEL_SHAPES["qwen3-8b"]
    n = stage_params(arch, 2, 1, 0)
    optimizer = 12 * n // 4  # main weights 4 + Adam moments 8 B a parameter, over DP 4
    per_rank = optimizer + total_params(arch) * 2 // 2 + (12 * n + 12 * n // 4 + 8 * n)
    state, need = host_memory_per_node(cfg, arch, 8)
    assert state == "save" and need == pytest.approx(8 * per_rank, abs=8 * 8)  # a few bytes of integer rounding
    check_host_memory(cfg, arch, ram_bytes=2 * 2**40, ranks_per_node=8)  # a 2 TiB node: fits
    with pytest.raises(PreflightError, match=r"host memory: the run's save state needs .* GB on a node of 8 ranks .* "
                                             r"this node has 512\.0 GB: .* dp_reshardable"):
        check_host_memory(cfg, arch, ram_bytes=512 * 10**9, ranks_per_node=8)
