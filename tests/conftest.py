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


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """Qwen3 family: per-head q/k norms, GQA, head_dim 32 apart from hidden 64 / 4 heads, no biases, tied
    embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", hidden_size=64, head_dim=32,
                            intermediate_size=128, tie_word_embeddings=True, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """Qwen3-MoE family: per-head q/k norms, 4 experts of 64, top-2 renormalised (norm_topk_prob), untied."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", hidden_size=64, head_dim=32,
                            intermediate_size=128, moe_intermediate_size=64, num_experts=4, top_k=2, seed=3)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory):
    """Mixtral family: 4 experts of 64 (w1/w3/w2), top-2, no q/k norms, tied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", hidden_size=64, head_dim=32,
                            intermediate_size=64, num_experts=4, top_k=2, tie_word_embeddings=True, seed=4)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """One two-node Slurm cluster on loopback for every launch test (tests/slurm_cluster.py), stopped by PID
    at the end of the session."""
    import slurm_cluster

    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        slurm_cluster.stop(cluster)
