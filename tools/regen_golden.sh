#!/usr/bin/env bash
# Re-record tests/golden/*.jsonl (the golden curves) from the runs of the tests that check them.
# A changed golden file must be explained in its commit: which behaviour changed, and why on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
MEGAREASON_WRITE_GOLDEN=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
  "tests/test_train_e2e.py::test_sigkill_mid_run_then_resume_gives_the_same_losses" \
  "tests/test_train_e2e.py::test_ppo_with_a_critic_runs_and_its_value_loss_falls" \
  "tests/test_train_e2e.py::test_raro_trains_logs_its_metrics_and_resumes_with_its_replay_buffer" \
  "tests/test_train_e2e.py::test_grpo_on_the_retrieval_qa_environment" \
  "tests/test_sft.py::test_sft_matches_transformers_stops_on_sigterm_and_resumes_to_the_golden_curve" \
  "tests/test_compare_methods.py::test_the_recipe_first_steps_on_the_tiny_model" \
  "tests/test_async_rollouts.py" "$@"
git status --short tests/golden
