"""Shared fixtures: tiny random checkpoints built in code (no downloads)."""

from __future__ import annotations

import os

import pytest

# Tests never download: every model is built here and every data set is a local file.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from megareason.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """Qwen2 family: GQA (4 query / 2 kv heads), QKV bias, untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Llama family: GQA, no biases, tied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tie_word_embeddings=True, seed=1)
