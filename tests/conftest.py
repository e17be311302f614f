"""Shared fixtures: tiny random checkpoints built in code (no downloads)."""

from __future__ import annotations

import ast
import functools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

# Tests never download: every model is built here and every data set is a local file.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# Two test processes run multi-process end-to-end runs side by side on 2 cores: OpenMP's idle threads sleep
# instead of spinning at each barrier (libgomp spins ~300,000 times by default), leaving the cores to the other
# processes. It changes when a waiting thread wakes, never what any thread computes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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


# Set-ups that only install (Debian's slurm-wlm and bubblewrap, NeMo-Run's own venv: ~1.5 minutes on a fresh
# machine) start in the background as soon as the session knows it runs a test that needs them, while the unit
# tests run.
_PREPARING: dict[str, Future] = {}


@functools.cache
def _cluster_tests() -> frozenset[str]:
    """``file::function`` of every test that takes the ``slurm`` fixture: they share one process (one cluster)."""
    found = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        text = path.read_text()
        if "slurm" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and any(
                    arg.arg == "slurm" for arg in node.args.args):
                found.add(f"tests/{path.name}::{node.name}")
    return frozenset(found)


@functools.cache
def _module_fixture_tests() -> frozenset[str]:
    """``file::function`` of every test that takes a fixture its own file declares ``scope="module"``: the
    tests of one file that share such a fixture run in one process, so the fixture's work (multi-rank runs,
    tens of seconds) is done once, not once per process."""
    found = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        shared = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and any(k.arg == "scope" and getattr(k.value, "value", None) == "module"
                                            for k in d.keywords) for d in node.decorator_list)}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and any(
                    arg.arg in shared for arg in node.args.args):
                found.add(f"tests/{path.name}::{node.name}")
    return frozenset(found)


def _work_unit(nodeid: str) -> str:
    """What one xdist process runs as a whole: the Slurm tests together, the tests of a file that share a
    module-scoped fixture together, every other test alone."""
    test = nodeid.split("[")[0].split("@")[0]
    if test in _cluster_tests():
        return "slurm"
    return test.split("::")[0] if test in _module_fixture_tests() else nodeid


# The end-to-end files that take longest (the 50 slowest tests that pytest prints at the end of a run), longest
# first. The scheduler hands out work in queue order: the longest end-to-end test first, then every unit test
# (the other process runs them while the first runs its end-to-end test: a multi-process run beside a unit test
# oversubscribes 2 cores less than two such runs do), then the other end-to-end tests longest first, so the
# last minutes hold short tests on both processes. The Slurm tests come after the unit tests: the installs they
# need (slurm-wlm, bubblewrap, NeMo-Run's venv) run in the background meanwhile.
_LONGEST_FIRST = ("test_faults.py", "test_async_rollouts.py", "test_compare_methods.py", "test_nemo_run.py",
                  "test_slurm.py", "test_train_e2e.py", "test_sft.py", "test_tinyv_server.py")


def pytest_collection_modifyitems(config, items):
    """The first of ``_LONGEST_FIRST``, the unit tests, then the other end-to-end tests (``slow``, and every test
    of the Slurm cluster's unit), the longest files first; file order within each rank."""
    def rank(item) -> tuple[int, int]:
        name = item.path.name
        slow = item.get_closest_marker("slow") is not None or _work_unit(item.nodeid) == "slurm"
        if not slow:
            return (1, 0)
        if name in _LONGEST_FIRST:
            i = _LONGEST_FIRST.index(name)
            return (0, 0) if i == 0 else (2, i)
        return (3, 0)

    items.sort(key=rank)  # stable: file order within each rank


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the units above, in collection order. xdist's own grouping (the ``xdist_group``
    mark) edits ``item._nodeid``, which pytest 9 no longer reads: the mark alone would split these tests."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # (it would sort the units by their number of tests)
    return UnitScheduling(config, log)


def pytest_collection_finish(session):
    import slurm_cluster

    from megareason.launch import launch_env

    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # (the other xdist workers: a fixture that needs the install waits for it on the lock files)
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    jobs = {"slurm": slurm_cluster.ensure_slurm, "launch_venv": launch_env.ensure,
            "bubblewrap": slurm_cluster.ensure_bubblewrap}
    todo = {name: job for name, job in jobs.items() if name in wanted}
    if todo:
        pool = ThreadPoolExecutor(len(todo), thread_name_prefix="prepare")
        _PREPARING.update({name: pool.submit(job) for name, job in todo.items()})
        pool.shutdown(wait=False)


def _prepared(name: str, job):
    """The background set-up's result (or its error), or the set-up run now when none started."""
    return _PREPARING[name].result() if name in _PREPARING else job()


@pytest.fixture(scope="session")
def launch_venv():
    """NeMo-Run's venv (.venv-launch, megareason.launch.launch_env): its interpreter."""
    from megareason.launch import launch_env

    return _prepared("launch_venv", launch_env.ensure)


@pytest.fixture(scope="session")
def bubblewrap():
    """Debian's bubblewrap (the read-only container sandbox of tests/slurm_cluster.py): its ``bwrap``."""
    import slurm_cluster

    return _prepared("bubblewrap", slurm_cluster.ensure_bubblewrap)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """One three-node Slurm cluster on loopback for every launch test (tests/slurm_cluster.py), stopped by PID
    at the end of the session."""
    import slurm_cluster

    _prepared("slurm", slurm_cluster.ensure_slurm)
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        slurm_cluster.stop(cluster)
