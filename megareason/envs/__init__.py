"""Agent environments: tool calls, multi-turn rollouts, retrieval QA (retrievers in ``retrieval``)."""
