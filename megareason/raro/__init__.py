"""RARO: the critic pass (critic.py), its prompts (prompts.py) and replay buffer (replay.py); the pure
functions live in megareason.algorithms.raro."""
