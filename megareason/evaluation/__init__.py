"""Evaluation: ``megareason eval`` (generate, score, summarize) and its metrics."""
