"""megareason: RL post-training for LLM reasoning on megatron-core and vLLM."""

__version__ = "0.1.0"
