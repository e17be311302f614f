"""Rollout: the vLLM engine behind one small interface (``engine``), its records (``records``), the
sleep/wake state machine and the weight transfer (weight sync lives in megareason.trainer)."""
