"""Cheap checks of an HF checkpoint directory, before any engine or worker reads it.

``check_hf_dir`` reads config.json, the tokenizer's JSON files and, of every ``.safetensors`` file, only
its first 8 bytes (the header's length) and the JSON header: no tensor data, so a 70B checkpoint is
checked in milliseconds. The byte length the header implies (8 + header + the last tensor's end offset)
must equal the file's size, as ``safetensors`` itself demands when it opens the file; a truncated copy
is named with both numbers instead of failing later inside vLLM's engine start or a Megatron worker.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from megareason.models.arch import ArchError, ModelArch

INDEX = "model.safetensors.index.json"
# Bytes per element of the safetensors dtypes (sub-byte float types are not size-checked).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors refuses larger headers
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class CheckpointError(ValueError):
    """A model directory that cannot be loaded as it is; the message names the file and the problem."""


def check_hf_dir(model_dir: str | Path, megatron: bool = False, tokenizer: bool = True) -> None:
    """Raise ``CheckpointError`` (or ``ArchError``) for the first problem of the HF checkpoint in
    ``model_dir``: config.json unreadable; with ``megatron`` an architecture the Megatron build does not
    support; no weights; with ``megatron`` tensors it needs that no file holds; a ``.safetensors`` file whose header is
    unreadable or whose size disagrees with it; an index naming a missing file or a tensor its file lacks;
    with ``tokenizer`` no tokenizer files or unreadable ones (``check_tokenizer``)."""
    model_dir = Path(model_dir)
    config = read_json(model_dir / "config.json", "model config")
    if not isinstance(config, dict):
        raise CheckpointError(f"model config {model_dir / 'config.json'} is not a JSON object")
    arch = _arch(config, model_dir / "config.json") if megatron else None  # architecture errors first
    names = check_weights(model_dir)
    if arch is not None and names is not None:
        from megareason.models import weight_map

        missing = [n for n in weight_map.hf_names(arch) if n not in names]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"model directory {model_dir} is missing {len(missing)} tensors: "
                                  f"{', '.join(missing[:5])}{more}")
    if tokenizer:
        check_tokenizer(model_dir)


def _arch(config: dict, path: Path) -> ModelArch:
    try:
        return ModelArch.from_hf_config(config, source=str(path))
    except ArchError:
        raise
    except KeyError as e:
        raise ArchError(f"model config {path} lacks {e}") from None
    except (TypeError, ValueError) as e:  # a field of the wrong type
        raise ArchError(f"model config {path}: {type(e).__name__}: {e}") from None


def check_weights(model_dir: Path) -> set[str] | None:
    """Check the safetensors files of ``model_dir`` (those its index names, else every ``*.safetensors``)
    and return the tensor names they hold; None when the weights are not safetensors (``*.bin``)."""
    index = model_dir / INDEX
    if index.exists():
        data = read_json(index, "model index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"model index {index} has no weight_map (tensor name -> file)")
        headers = {}
        for file in sorted(set(weight_map.values())):
            path = model_dir / str(file)
            if not path.is_file():
                raise CheckpointError(f"model index {index} names {file}, which is missing")
            headers[file] = safetensors_header(path)
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise CheckpointError(f"model index {index} puts tensor '{name}' in {file}, which does not hold it")
        return {n for h in headers.values() for n in h}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if any(model_dir.glob("*.bin")):
            return None
        raise CheckpointError(f"model directory {model_dir} has no weights (model.safetensors, or {INDEX} and "
                              "the files it names)")
    return {n for f in files for n in safetensors_header(f)}


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors of a ``.safetensors`` file's header (name -> dtype, shape, data_offsets), after checking
    that the header parses, that each tensor's byte range fits its dtype and shape, that the ranges follow
    one another, and that the file holds exactly the bytes they add up to. Reads only the header."""
    size = path.stat().st_size
    where = f"model file {path}"
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{where} is truncated: the file has {size} bytes, not even the 8-byte length of "
                                  "its header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CheckpointError(f"{where} is not a safetensors file (its first 8 bytes give a header of "
                                  f"{n:,} bytes)")
        if 8 + n > size:
            raise CheckpointError(f"{where} is truncated: its JSON header alone is {n:,} bytes, the file has "
                                  f"{size:,}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where} has an unreadable header: {e}") from None
    header.pop("__metadata__", None)
    end = 0
    for name, info in sorted(header.items(), key=lambda kv: _offsets(kv[1])):
        begin, stop = _offsets(info)
        if (begin, stop) == (-1, -1):
            raise CheckpointError(f"{where} has an unreadable header: tensor '{name}' has no valid dtype, shape "
                                  f"and data_offsets: {json.dumps(info)[:120]}")
        if begin != end or stop < begin:
            raise CheckpointError(f"{where} has an inconsistent header: tensor '{name}' occupies bytes "
                                  f"[{begin:,}, {stop:,}), expected to start at {end:,}")
        width = DTYPE_BYTES.get(info["dtype"])
        if width is not None and math.prod(info["shape"]) * width != stop - begin:
            raise CheckpointError(f"{where} has an inconsistent header: tensor '{name}' ({info['dtype']}, shape "
                                  f"{info['shape']}) needs {math.prod(info['shape']) * width:,} bytes, its "
                                  f"data_offsets give {stop - begin:,}")
        end = stop
    expected = 8 + n + end  # the length, the JSON header, the tensors
    if size < expected:
        raise CheckpointError(f"{where} is truncated: its header says {expected:,} bytes, the file has {size:,}")
    if size > expected:
        extra = size - expected
        raise CheckpointError(f"{where} has {extra:,} byte{'s' * (extra > 1)} after its last tensor: its header says "
                              f"{expected:,} bytes, the file has {size:,}")
    return header


def _offsets(info) -> tuple[int, int]:
    """A header entry's (begin, end), or (-1, -1) when the entry is malformed."""
    ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
          and all(isinstance(d, int) and d >= 0 for d in info["shape"]) and isinstance(info.get("data_offsets"), list)
          and len(info["data_offsets"]) == 2 and all(isinstance(o, int) for o in info["data_offsets"]))
    return tuple(info["data_offsets"]) if ok else (-1, -1)


def check_tokenizer(folder: str | Path) -> None:
    """The tokenizer in ``folder`` has its files (tokenizer.json, tokenizer.model, vocab.json or vocab.txt)
    and its JSON files parse; ``CheckpointError`` otherwise. Nothing is imported."""
    folder = Path(folder)
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise CheckpointError(f"tokenizer folder {folder} has no tokenizer ({', '.join(_TOKENIZER_FILES)})")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        if (folder / name).exists() and not isinstance(read_json(folder / name, "tokenizer file"), dict):
            raise CheckpointError(f"tokenizer file {folder / name} is not a JSON object")


def read_json(path: Path, what: str):
    """The JSON value in ``path``; ``CheckpointError`` naming ``what`` and ``path`` when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") \
            from None
