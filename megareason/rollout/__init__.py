"""Rollout: the vLLM engine behind one small interface (weight sync lives in megareason.trainer)."""

from megareason.rollout.engine import Completion, EngineSettings, RolloutEngine, Sampling, VLLMEngine

__all__ = ["Completion", "EngineSettings", "RolloutEngine", "Sampling", "VLLMEngine"]
