"""Megatron checkpoints with ``megatron.core.dist_checkpointing``: atomic, reshardable on load.

Layout of a checkpoint directory::

    <dir>/            dist_checkpointing files (model, optionally optimizer), any TP/PP on load
    <dir>/hf/         config.json, generation config and tokenizer of the HF model it came from
    <dir>/megareason.json   what wrote it: the architecture, the TP/PP it was saved from, user metadata

Every rank writes into ``<dir>.tmp-<id>`` and rank 0 renames it to ``<dir>`` once all ranks are done,
so a crash mid-save leaves the previous checkpoint (if any) intact and never a half-written one. An
asynchronous save (``save_checkpoint(..., asynchronous=True)``, megatron-core's) stages the state in host
memory and returns; a forked process per rank writes it, and ``finish_saves`` renames it once every rank's
write has finished.

Saves and loads are spread over the data-parallel replicas (megatron-core's fully parallel strategies):
the DP ranks that hold the same TP x PP shard split its tensors between them, so each writes about
1/DP of it (rather than DP rank 0 writing all of it while the others wait), and on load each reads about
1/DP of it and the ranks exchange the rest over the DP group. A save of B bytes thus writes about
B / nodes on every node (``launch/preemption.py`` assumes that).

Optimizer state is saved and resharded like the model (any TP/PP/DP on load). The distributed
optimizer's (``optim.use_distributed_optimizer``) goes in megatron-core's ``fully_reshardable`` format
(gathered over DP on save, sliced per rank on load; 0.16.1's default format no longer saves at all),
recorded in megareason.json as ``distrib_optim_sharding_type``. It loads only into a distributed
optimizer, and the plain optimizer's only into a plain one. Without TransformerEngine or Apex,
megatron-core steps with torch's Adam, whose per-parameter ``step`` its distributed-optimizer loader
mishandles; ``load_checkpoint`` works around that (``_distributed_optimizer_loading``), on GPU and CPU.
"""

from __future__ import annotations

import functools
import json
import queue
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from megareason.models.arch import ModelArch
from megareason.models.parallel import current_layout
from megareason.utils import OccupiedFolder, OutputKind, check_replaceable, replace_directory

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
META = "megareason.json"
SHARDING_KEY = "distrib_optim_sharding_type"  # megatron-core's metadata key, and ours in META
OPTIMIZERS_KEY = "chained_optimizers"  # in META: how many optimizers megatron-core chained at the save
# Reshards over TP, PP and DP (gathers over DP on save; see docs/architecture.md for its memory cost).
DISTRIB_OPTIM_SHARDING = "fully_reshardable"
# A checkpoint folder: what replaces an earlier one (and nothing else). dist_checkpointing's torch_dist
# format writes .metadata, common.pt, metadata.json and a __<rank>_<n>.distcp file per rank and writer.
CHECKPOINT = OutputKind("megareason checkpoint", marks=(META,),
                        entries=(META, "hf", ".metadata", "common.pt", "metadata.json", "*.distcp"))


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(path: str | Path, model, arch: ModelArch, hf_dir: str | Path, optimizer=None,
                    metadata: dict | None = None, asynchronous: bool = False) -> Path:
    """Save ``model`` (and ``optimizer``) to ``path`` from every rank; returns the final path.

    ``asynchronous``: megatron-core's asynchronous save. The state is staged in host memory before this
    returns (``_stage_on_host``), a process forked per rank writes it while training goes on, and
    ``finish_saves`` (called on every rank alike) commits it: ``path`` appears only once every rank's
    write has finished. Until then the previous checkpoint at ``path``, if any, is untouched."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    distributed = _distributed_optimizers(optimizer)
    sharding = DISTRIB_OPTIM_SHARDING if distributed else None
    for d in distributed:  # before anything is written
        _init_state(d)
    occupied = _broadcast(_occupied(path) if dist.get_rank() == 0 else None)  # every rank stops alike
    if occupied:
        raise OccupiedFolder(occupied)
    tmp = Path(_broadcast(f"{path}.tmp-{uuid.uuid4().hex[:8]}" if dist.get_rank() == 0 else None))
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    layout = current_layout()
    meta = {"arch": asdict(arch), "saved_tp": layout.tp, "saved_pp": layout.pp, "saved_ep": layout.ep,
            "has_optimizer": optimizer is not None, **(metadata or {}), SHARDING_KEY: sharding}
    if optimizer is not None:
        meta[OPTIMIZERS_KEY] = _optimizer_count(optimizer)
    commit = functools.partial(_commit, tmp, path, Path(hf_dir), meta)
    try:
        state = {"model": model.sharded_state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(state["model"], **_sharding_kwargs(sharding))
        if asynchronous:
            request = dist_checkpointing.save(state, str(tmp), sharded_strategy=_save_strategy(),
                                              async_sharded_save=True)
            del state  # the device tensors go once staged (the buckets hold the host copies)
            request = _stage_on_host(request)
            request.add_finalize_fn(commit)
            _async_saves().schedule_async_request(request)
            _PENDING.append(tmp)
            return path
        _in_process_results()
        dist_checkpointing.save(state, str(tmp), sharded_strategy=_save_strategy())
        commit()
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if not asynchronous:
            _stop_writer_manager()
    return path


def _commit(tmp: Path, path: Path, hf_dir: Path, meta: dict) -> None:
    """Once every rank has written its files into ``tmp``: rank 0 adds the HF config and tokenizer files and
    ``megareason.json``, then renames ``tmp`` to ``path`` (replacing an earlier checkpoint there)."""
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "hf").mkdir()
        for name in HF_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, tmp / "hf" / name)
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        replace_directory(tmp, path, CHECKPOINT)
    dist.barrier()


# This process's asynchronous saves (megatron-core's queue: a forked writer per save) and their folders.
_QUEUE = None
_PENDING: list[Path] = []


def _async_saves():
    global _QUEUE
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if _QUEUE is None:
        _QUEUE = AsyncCallsQueue(persistent=False)
    return _QUEUE


def _stage_on_host(request):
    """Stage the tensors the request will write in host memory now, in place in its write buckets.

    megatron-core stages them when the request is scheduled (``FileSystemWriterAsync.preload_tensors``: a
    device-to-host copy) into a list of its own, while the request and the writer keep the device tensors
    referenced until the save is finalized: for the distributed optimizer's ``fully_reshardable`` state,
    buffers gathered for the save (12 bytes a parameter) would stay on the GPU beside the next generation's
    KV cache. The same copy made into the buckets the writer shares frees them when the save returns. A CPU
    tensor stages as itself: the writer, forked at the schedule, sees it as it was then (copy-on-write)."""
    if request.async_fn is None:  # nothing for this rank to write
        return request
    buckets = request.async_fn_args[1]
    buckets[:] = [(file, key, (data, [(item, t.detach().to("cpu")) for item, t in tensors]))
                  for file, key, (data, tensors) in buckets]
    return request._replace(preload_fn=None)


def finish_saves(blocking: bool = True) -> bool:
    """Commit this process's asynchronous saves whose writes have finished on every rank (all of them, waiting,
    with ``blocking``); True when none is left. A collective while any is pending: call it on every rank of
    the group alike. A write that failed on any rank raises on every rank, and its folder is removed."""
    if _QUEUE is None or not _QUEUE.get_num_unfinalized_calls():
        return True
    try:
        done = len(_QUEUE.maybe_finalize_async_calls(blocking=blocking))
    except BaseException:
        if dist.get_rank() == 0:
            for tmp in _PENDING:
                shutil.rmtree(tmp, ignore_errors=True)
        _PENDING.clear()
        _QUEUE.async_calls.clear()
        _stop_writer_manager()
        raise
    del _PENDING[:done]
    if _QUEUE.get_num_unfinalized_calls():
        return False
    _stop_writer_manager()
    return True


def _save_strategy():
    """megatron-core's default (torch_dist) writer, its work split over the data-parallel group.

    Every DP replica holds the same model and, with the distributed optimizer's ``fully_reshardable``
    format, the same gathered optimizer state; megatron-core marks DP rank 0's copy as the one to write.
    The wrapper reassigns each tensor to the DP rank with the fewest bytes so far, so the replicas write
    about equal shares. With context parallelism the CP ranks hold replicas too (megatron-core's
    ``with_context_parallel``). At DP = 1 it writes exactly what the plain writer would.
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    # Each save plans its own split (one all-gather of the tensors' metadata over the DP group, no data):
    # the wrapper is built per save, so a cached plan would never be reused.
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True),
                                            do_cache_distribution=False)


def _load_strategy(path: Path):
    """megatron-core's reader for ``path``, its reads split over the data-parallel group.

    Each DP rank reads about 1/DP of the tensors its replica needs and they broadcast them to each other
    over the DP group, instead of every replica reading the whole of its TP x PP shard (the distributed
    optimizer's ``fully_reshardable`` state included) from the file system. Which tensors a rank needs
    follows the layout it loads at, so resharding over TP, PP and DP is unchanged; at DP = 1 it is the
    plain reader.
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def _occupied(path: Path) -> str | None:
    """Why ``path`` may not be replaced by a checkpoint (``utils.check_replaceable``), or None."""
    try:
        check_replaceable(path, CHECKPOINT)
    except OccupiedFolder as e:
        return str(e)
    return None


def _in_process_results() -> None:
    """dist_checkpointing's file writer reports what it wrote through a module-level queue, which it creates
    as a spawned multiprocessing Manager's (``filesystem_async._get_write_results_queue``): a Python process
    started for each save here (it is stopped after each, below), about a second of start-up and another
    of shutdown. A synchronous save puts its results and reads them back in this process
    (``AsyncRequest.execute_sync``: its writer processes report to it through a queue of their own), so a
    plain queue serves it. An asynchronous save (its writer forked) keeps megatron-core's Manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _stop_writer_manager()
    filesystem_async._results_queue = queue.Queue()


def _stop_writer_manager() -> None:
    """dist_checkpointing's file writer keeps a spawned multiprocessing Manager (~360 MB) alive for the
    life of the process, and it outlives a SIGKILLed trainer. Shut it down after every save; the next
    save starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None


def _distributed_optimizers(optimizer) -> list:
    """The megatron-core ``DistributedOptimizer``s inside ``optimizer`` (none for the plain one)."""
    from megatron.core.optimizer import DistributedOptimizer

    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in chained if isinstance(o, DistributedOptimizer)]


def _optimizer_count(optimizer) -> int:
    """How many optimizers megatron-core chains in ``optimizer``: one, or at expert parallelism > 1 one for
    the dense parameters and one for the experts' (``get_megatron_optimizer``)."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def _check_optimizer_split(path: Path | str, meta: dict, optimizer) -> None:
    """Refuse, before any collective and alike on every rank, optimizer state saved by another number of
    chained optimizers than ``optimizer`` has: their state is keyed per optimizer (``chained_0.``,
    ``chained_1.``) with param groups per optimizer, and megatron-core does not map one split onto the other
    (it would fail deep in the load with a key missing). The model's weights reshard over EP as over TP/PP."""
    saved = meta.get(OPTIMIZERS_KEY)
    if optimizer is None or saved is None or saved == _optimizer_count(optimizer):
        return
    now, ep = _optimizer_count(optimizer), current_layout().ep
    raise ValueError(
        f"{path}: its optimizer state was saved by {saved} optimizer(s) at expert parallelism "
        f"{meta.get('saved_ep', '?')}, and this run has {now} at expert parallelism {ep}: megatron-core keeps the "
        "experts' optimizer state in an optimizer of its own when expert parallelism is > 1, and that state does "
        f"not reshard between the two splits. Resume with parallel.expert_model_parallel_size="
        f"{meta.get('saved_ep', '?')} (tensor, pipeline and data parallelism may change), or start a new run from "
        f"its weights alone: megareason convert megatron-to-hf {path} OUT, then model.path=OUT")


def _sharding_kwargs(sharding: str | None) -> dict:
    return {"metadata": {SHARDING_KEY: sharding}} if sharding else {}


def _init_state(dopt) -> None:
    """Give a distributed optimizer that has not stepped yet its per-parameter state, as its first step would.

    Its ``state_dict()`` (called by ``sharded_state_dict``, on save and on load) reads that state, which the
    optimizers create lazily at their first step. torch's Adam (megatron-core's without TransformerEngine or
    Apex) keeps ``step`` per parameter: created here with ``step`` 0 and zero moments. TransformerEngine's
    and Apex's FusedAdam (megatron-core's Adam when they are installed, as in the NGC containers) keep
    ``step`` in the parameter group and only the moments per parameter: megatron-core's own
    ``init_state_fn`` (``optimizer/__init__.py``) creates those zero moments, what their first step would.
    (Its ``_init_optimizer_states_with_dummy_values`` instead runs a step on zero gradients, which applies
    the weight decay and counts a step: not a state to save.) A saved unstepped optimizer resumes exactly.
    """
    inner = dopt.optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    if all(inner.state.get(p) for p in params):
        return
    if isinstance(inner, torch.optim.Adam):
        for group in inner.param_groups:
            assert not (group["amsgrad"] or group["fused"] or group["capturable"]), "megatron-core sets none"
            for p in group["params"]:
                if not inner.state.get(p):
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}
    else:
        dopt.init_state_fn(inner, dopt.config)


@contextmanager
def _distributed_optimizer_loading(distributed: list):
    """Work around megatron-core 0.16.1's distributed-optimizer loader under torch's Adam (no TE/Apex).

    1. ``load_parameter_state_from_fully_reshardable`` leaves ``step`` out of the loaded tensors on
       purpose (``load_state_dict`` restores it from the param groups), but
       ``_set_main_param_and_optimizer_states`` copies every key of the optimizer's per-parameter state,
       which for torch's Adam includes ``step``: ``KeyError: 'step'``. Keys the loader leaves out keep
       their value here.
    2. ``load_state_dict`` puts one ``step`` tensor into every parameter's state, and torch's Adam adds 1
       to each parameter's ``step`` in place: after a resume ``step`` would grow by the number of
       parameters per step (wrong bias correction). Each parameter gets its own copy afterwards.
    """
    for d in distributed:
        def keep_unloaded(model_param, tensors, d=d, set_states=d._set_main_param_and_optimizer_states):
            return set_states(model_param, {**d._get_main_param_and_optimizer_states(model_param), **tensors})

        d._set_main_param_and_optimizer_states = keep_unloaded
    try:
        yield
    finally:
        for d in distributed:
            del d._set_main_param_and_optimizer_states  # the class's method again
    for d in distributed:
        for state in d.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def read_metadata(path: str | Path) -> dict:
    """The checkpoint's megareason.json (``arch``, ``saved_tp``, ``saved_pp``, ``has_optimizer``, the
    saver's metadata); ``FileNotFoundError`` when ``path`` is not a megareason checkpoint. No collective."""
    meta = Path(path) / META
    if not meta.is_file():
        raise FileNotFoundError(f"{path}: not a megareason checkpoint (no {META})")
    return json.loads(meta.read_text())


def checkpoint_arch(path: str | Path) -> ModelArch:
    """The ``ModelArch`` the checkpoint at ``path`` was saved with (from its megareason.json)."""
    return ModelArch(**read_metadata(path)["arch"])


def load_checkpoint(path: str | Path, model, optimizer=None) -> dict:
    """Load ``path`` into this rank's ``model`` (any TP/PP layout) and ``optimizer``; returns the metadata."""
    from megatron.core import dist_checkpointing

    from megareason.models.lora import lora_modules

    meta = read_metadata(path)
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"{path}: checkpoint has no optimizer state")
    if bool(meta.get("lora")) != bool(lora_modules(model)):
        has = "has LoRA adapters" if meta.get("lora") else "has no LoRA adapters"
        raise ValueError(f"{path}: the checkpoint {has} and the model {'does not' if meta.get('lora') else 'does'}; "
                         "build the model with the checkpoint's lora settings (megareason.json: lora)")
    _check_optimizer_split(path, meta, optimizer)
    distributed = _distributed_optimizers(optimizer)
    sharding = meta.get(SHARDING_KEY)
    if optimizer is not None and bool(distributed) != bool(sharding):
        raise ValueError(f"{path}: the optimizer state was saved {'with' if sharding else 'without'} the distributed "
                         f"optimizer; resume with optim.use_distributed_optimizer={str(bool(sharding)).lower()}")
    for d in distributed:
        _init_state(d)
    state = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True, **_sharding_kwargs(sharding))
    loaded = dist_checkpointing.load(state, str(path), sharded_strategy=_load_strategy(path))
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        with _distributed_optimizer_loading(distributed):
            optimizer.load_state_dict(loaded["optimizer"])
    return meta
