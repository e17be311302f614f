"""What ``megareason eval | train | sft | benchmark | convert`` check before any engine, worker or Ray
cluster starts: every model directory (``models.hf_check``: config.json, the architecture where Megatron
builds the model, each safetensors file's header against its size and the index, the tokenizer's files),
every data file named in the config, that the output folder can be written, and (train, sft) that its file
system has room for the checkpoints the run keeps (``check_checkpoint_space``). Each problem is one line
naming the path and what is wrong; all of them are reported at once (``PreflightError``), and the CLI
exits with code 2. Nothing is created: the output folder's nearest existing ancestor gets a probe file,
removed at once. A Slurm job runs the train checks before it starts Ray (``launch/slurm_job.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from megareason.config.schema import Config
from megareason.data import DataError
from megareason.models.arch import ArchError
from megareason.models.hf_check import CheckpointError, check_hf_dir, check_tokenizer
from megareason.models.hub import resolve_model_path
from megareason.utils import OccupiedFolder, check_replaceable

_FILE_KINDS = ("file", "musique")  # data.sources kinds that read data.sources[].path


class PreflightError(ValueError):
    """The problems found before launching, one line each (``str`` joins them with "error: " lines, as the
    CLI prints its errors)."""

    def __init__(self, problems: list[str]):
        super().__init__("\nerror: ".join(problems))
        self.problems = problems


def check_run(cfg: Config, command: str) -> None:
    """The inputs of ``megareason <command>`` (eval, train, sft or benchmark) for ``cfg``; raises
    ``PreflightError`` listing every problem. train and sft also need what the Megatron build needs."""
    problems: list[str] = []
    megatron = command in ("train", "sft")
    models = (cfg.benchmark.models or [cfg.model.path]) if command == "benchmark" else [cfg.model.path]
    for model in models:
        _collect(problems, lambda m=model: check_hf_dir(resolve_model_path(m), megatron=megatron,
                                                         tokenizer=not cfg.model.tokenizer))
    if cfg.model.tokenizer:
        _collect(problems, lambda: check_tokenizer(resolve_model_path(cfg.model.tokenizer)))
    groups = [("data.sources", cfg.data.sources)]
    if command in ("train", "sft"):
        groups.append(("data.val_sources", cfg.data.val_sources))
    for key, sources in groups:
        for i, source in enumerate(sources):
            if source.kind in _FILE_KINDS:
                _collect(problems, lambda s=source, k=f"{key}[{i}].path": check_data_file(s.path, k))
    out_key = {"eval": "eval.output_dir", "benchmark": "benchmark.output_dir"}.get(command, "trainer.output_dir")
    out = {"eval": cfg.eval.output_dir, "benchmark": cfg.benchmark.output_dir}.get(command, cfg.trainer.output_dir)
    _collect(problems, lambda: check_writable(out, out_key))
    if megatron:
        from megareason.trainer.run_dir import check_run_folder

        _collect(problems, lambda: check_run_folder(out))
        _collect(problems, lambda: check_checkpoint_space(cfg))
        _collect(problems, lambda: check_host_memory(cfg))
    if problems:
        raise PreflightError(problems)


def checkpoints_to_fit(cfg: Config, existing: int) -> int:
    """Checkpoints of ``cfg``'s run that its folder's file system must still fit, at the peak, beside the
    ``existing`` complete ones there: a save writes the new checkpoint in full before it deletes all but
    the last ``trainer.keep_last``, so a run's folder holds up to keep_last + 1 at once; a run that saves
    fewer times (trainer.save_every, the last step) holds fewer."""
    t = cfg.trainer
    if t.save_every_minutes > 0:
        saves = t.keep_last + 1  # as many as time allows
    else:
        saves = -(-t.steps // t.save_every) if t.save_every > 0 else 1  # every save_every steps and the last
    return max(1, min(saves, t.keep_last + 1 - existing))


def check_checkpoint_space(cfg: Config, key: str = "trainer.output_dir") -> None:
    """The file system of ``cfg``'s run folder (its nearest existing ancestor) has room for the checkpoints
    the run keeps plus the one being written (``checkpoints_to_fit``), each of ``preemption.checkpoint_bytes``
    for the parameter count in the model's config.json. ``PreflightError`` naming the folder, the bytes needed
    and free otherwise. A model whose config.json cannot be read is skipped here (``check_hf_dir`` reports
    it). The free space is the file system's (``statvfs``): a user or project quota below it is not seen."""
    from megareason.launch.plan_memory import total_params
    from megareason.launch.preemption import checkpoint_bytes, trainable_params
    from megareason.models.arch import ModelArch
    from megareason.trainer.run_dir import RunDir

    try:
        arch = ModelArch.from_pretrained(resolve_model_path(cfg.model.path))
    except (ArchError, FileNotFoundError, OSError, ValueError):
        return
    params = total_params(arch)
    each = checkpoint_bytes(cfg, params, trainable_params(cfg, arch))
    out = Path(cfg.trainer.output_dir).expanduser().absolute()
    existing = len(RunDir(out).steps()) if out.is_dir() else 0
    count = checkpoints_to_fit(cfg, existing)
    probe = out
    while not probe.exists():
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:  # not readable: check_writable reports the folder
        return
    if free < count * each:
        there = f", {existing} of them there already" if existing else ""
        raise PreflightError([
            f"output folder {out} has {_size(free)} free on its file system ({probe}); the run needs "
            f"{_size(count * each)}: {count} more checkpoint(s) of {_size(each)} ({params / 1e9:.2f}B parameters, "
            f"{cfg.trainer.precision} weights + Adam state), as it keeps trainer.keep_last={cfg.trainer.keep_last} "
            f"plus one being written{there}; free space there, lower trainer.keep_last, or name a folder on a "
            f"larger file system ({key})"])


def host_memory_per_node(cfg: Config, arch, ranks_per_node: int) -> tuple[str, int]:
    """(state, bytes): the host memory ``ranks_per_node`` ranks of ``cfg``'s run hold at the peak, as ``megareason
    plan`` counts it (``launch/ledger.py``: pinned offload copies, the reference, vLLM's level-1 sleep copy,
    megatron-core's fully_reshardable save and load), on the most loaded pipeline stage."""
    from megareason.launch.ledger import plan_states, rank_terms
    from megareason.launch.plan_records import GPUS, PlanOptions, workload

    rows = sum(p.tokens for p in workload(cfg, PlanOptions()))
    peaks: dict[str, int] = {}
    for stage in range(cfg.parallel.pipeline_model_parallel_size):  # host terms do not depend on the GPU model
        led = plan_states(cfg, rank_terms(cfg, arch, GPUS["H100-80GB"], stage, rows))
        for state, n in led.host_peaks.items():
            peaks[state] = max(peaks.get(state, 0), n)
    state = max(peaks, key=peaks.get)
    return state, ranks_per_node * peaks[state]


def check_host_memory(cfg: Config, arch=None, ram_bytes: int | None = None, ranks_per_node: int | None = None) -> None:
    """The run's host memory on this node (``host_memory_per_node``, for the ranks this node holds: its GPUs,
    or on CPU every rank) is within the node's RAM. ``PreflightError`` naming the state, the bytes and what to
    change otherwise. A model whose config.json cannot be read is skipped here (``check_hf_dir`` reports it)."""
    import torch

    from megareason.models.arch import ModelArch

    if arch is None:
        try:
            arch = ModelArch.from_pretrained(resolve_model_path(cfg.model.path))
        except (ArchError, FileNotFoundError, OSError, ValueError):
            return
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.data_parallel_size
    if ranks_per_node is None:
        ranks_per_node = min(world, torch.cuda.device_count() or world)
    if ram_bytes is None:
        ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    state, need = host_memory_per_node(cfg, arch, ranks_per_node)
    if need > ram_bytes:
        raise PreflightError([
            f"host memory: the run's {state} state needs {_size(need)} on a node of {ranks_per_node} ranks (pinned "
            f"offload copies, vLLM's sleep copy, and megatron-core's fully_reshardable checkpoint gathering ~20 bytes "
            f"per parameter of each rank's shard on every rank), this node has {_size(ram_bytes)}: spread the ranks "
            f"over more nodes (parallel.*), or save in megatron-core's dp_reshardable format (no gather over DP)"])


def _size(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def check_convert(source: str, out_dir: str, hf_source: bool, peft: bool = False) -> None:
    """``megareason convert``: the source (an HF directory or known model name with ``hf_source``, else a
    megareason checkpoint), that ``out_dir`` can be written (it is replaced by a rename from a folder
    beside it, so its parent is probed) and that an existing ``out_dir`` is empty or an earlier export of
    the same kind (a checkpoint; with ``peft`` a PEFT adapter, else an HF model folder)."""
    from megareason.models.checkpoint import CHECKPOINT
    from megareason.models.convert import HF_MODEL, PEFT_ADAPTER

    problems: list[str] = []
    inside = _checkpoint_inside(Path(source))
    if hf_source and inside is not None:
        problems.append(f"{source} holds a megareason checkpoint, not a Hugging Face model; to export it: megareason "
                        f"convert megatron-to-hf {inside} OUT_DIR")
    elif hf_source:
        found: list[str] = []
        _collect(found, lambda: check_hf_dir(resolve_model_path(source), megatron=True))
        problems += [m.replace("model.path '", "the source '", 1) for m in found]  # not a config key here
    elif inside is not None and inside != Path(source):
        problems.append(f"checkpoint {source} is a {'run' if (Path(source) / 'checkpoints').is_dir() else 'step'} "
                        f"folder, not a model's checkpoint: did you mean {inside}?")
    else:
        _collect(problems, lambda: _check_megareason_checkpoint(Path(source)))
    _collect(problems, lambda: check_writable(Path(out_dir).absolute().parent, f"the parent of {out_dir}"))
    kind = CHECKPOINT if hf_source else PEFT_ADAPTER if peft else HF_MODEL
    _collect(problems, lambda: check_replaceable(Path(out_dir), kind))
    if problems:
        raise PreflightError(problems)


def _checkpoint_inside(path: Path) -> Path | None:
    """The policy's checkpoint at ``path`` itself, in the step folder ``path`` (its ``actor``) or in the run
    folder ``path`` (its newest step's ``actor``); None when there is none."""
    from megareason.models.checkpoint import META

    if (path / META).is_file():
        return path
    if (path / "actor" / META).is_file():
        return path / "actor"
    steps = sorted((path / "checkpoints").glob(f"step_*/actor/{META}")) if path.is_dir() else []
    return steps[-1].parent if steps else None


def _check_megareason_checkpoint(path: Path) -> None:
    from megareason.models.checkpoint import META
    from megareason.models.hf_check import read_json

    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a folder" if path.exists() else f"checkpoint {path} "
                              "does not exist")
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} is not a megareason checkpoint (no {META})")
    meta = read_json(path / META, "checkpoint metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("arch"), dict):
        raise CheckpointError(f"checkpoint metadata {path / META} has no 'arch' object")


def check_data_file(path: str, key: str) -> None:
    """``path`` (the config's ``key``) is a readable file; ``DataError`` otherwise."""
    if not path:
        raise DataError(f"{key} is empty: a file source needs a path")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data file {p} does not exist ({key})")
    if not p.is_file():
        raise DataError(f"data file {p} is not a file ({key})")
    try:
        with p.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise DataError(f"data file {p} cannot be read: {e.strerror} ({key})") from None


def check_writable(folder: str | Path, key: str) -> None:
    """Files can be created in ``folder`` (the config's ``key``), or, when it does not exist yet, in its
    nearest existing ancestor; probed with a file created and removed at once. ``PreflightError``
    otherwise."""
    p = Path(folder).expanduser().absolute()
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == p else f"cannot be created: {existing} is a file"
        raise PreflightError([f"output folder {p} {what} ({key})"])
    try:
        fd, probe = tempfile.mkstemp(prefix=".megareason-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "" if existing == p else f" (it would be created in {existing})"
        raise PreflightError([f"output folder {p} is not writable{where}: {e.strerror} ({key})"]) from None


def _collect(problems: list[str], check: Callable[[], None]) -> None:
    try:
        check()
    except PreflightError as e:
        problems.extend(e.problems)
    except (CheckpointError, ArchError, DataError, FileNotFoundError, OccupiedFolder) as e:
        problems.append(str(e))
