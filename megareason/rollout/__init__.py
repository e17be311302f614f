"""Rollout: the vLLM engine behind one small interface (weight sync comes with the Megatron issue)."""

from megareason.rollout.engine import Completion, EngineSettings, RolloutEngine, Sampling, VLLMEngine

__all__ = ["Completion", "EngineSettings", "RolloutEngine", "Sampling", "VLLMEngine"]
