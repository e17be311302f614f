"""Rollout: the vLLM engine behind one small interface (``records.RolloutEngine``), its records
(``records``), the sleep/wake state machine (``engine_state``), the colocated SPMD engine (``colocated``)
and the weight transfer (``weight_sync``, ``buckets``, ``transfer``).

Modules outside this package start an engine with ``start_engine`` and hold it as a ``RolloutEngine``:
``engine.py``, which imports vLLM, stays this package's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megareason.rollout.engine import VLLMEngine
    from megareason.rollout.records import EngineSettings


def start_engine(settings: EngineSettings, index: int = 0) -> VLLMEngine:
    """A vLLM engine of ``settings`` (``engine.VLLMEngine``); ``index``: which of the run's engines on this node
    it is (it picks the engine's ports). vLLM is imported here, on the first call."""
    from megareason.rollout.engine import VLLMEngine

    return VLLMEngine(settings, index)
