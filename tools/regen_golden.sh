#!/usr/bin/env bash
# Re-record tests/golden/*.jsonl (the golden curves) from the runs of the tests that check them.
# A changed golden file must be explained in its commit: which behaviour changed, and why on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
MEGAREASON_WRITE_GOLDEN=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
  "tests/test_nemo_run.py::test_local_executor_runs_ppo_with_a_critic_whose_value_loss_falls" \
  "tests/test_train_e2e.py::test_raro_with_lora_trains_logs_its_metrics_and_resumes_with_its_replay_buffer" \
  "tests/test_train_e2e.py::test_grpo_on_the_retrieval_qa_environment" \
  "tests/test_sft.py::test_sft_with_lora_matches_transformers_stops_on_sigterm_and_resumes_to_the_golden_curve" \
  "tests/test_compare_methods.py::test_the_recipe_first_steps_on_the_tiny_model" \
  "tests/test_nemo_run.py::test_slurm_job_on_two_nodes_requeues_on_usr1_then_on_sigterm_and_resumes_to_the_golden_curve" \
  "tests/test_train_e2e.py::test_colocated_tp2_engine_takes_the_sync_and_a_sigterm_in_each_phase_resumes_to_the_uninterrupted_run" \
  "tests/test_async_rollouts.py" "$@"
git status --short tests/golden
