#!/usr/bin/env bash
# The CUDA check, in one go (a few minutes): install what is missing, then run the torch e2e
# smoke tests and the MLX-quantized checks on --device cuda and the decode and serving
# benchmarks there. Paste the output
# (also written to $OUT/gpu_check.log where $OUT is set) into docs/benchmarks.md.
#
# On the lent GPU machine, which reaches no package index or hub (see the device tool's README):
#   here:   .venv/bin/python -m scripts.bench.gpu_prepare      # packs .gpu/ (wheels, model files)
#   there:  bash scripts/bench/gpu_check.sh                     # a device run carrying ".gpu"
# It installs from .gpu/wheels into that machine's Python (its CUDA torch stays), and serves a
# random-weight twin of SmolLM2 built from .gpu/model, since the real weights do not fit in a
# call. On a CUDA machine with the default model in $MLXCEL_MODELS_DIR and mlxcel installed,
# the same command serves the real weights. GPU_CHECK_DEVICE=cpu rehearses the whole check on a
# CPU machine.
set -uo pipefail
source "$(dirname "$0")/check_env.sh"
DEVICE=${GPU_CHECK_DEVICE:-cuda}

check() {
  step "environment"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not found"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
  torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" \
    || { echo "torch does not import"; return 1; }
  [ "$DEVICE" = cpu ] || "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    || { echo "torch sees no CUDA device"; return 1; }

  IMPORTS="import mlxcel.cli.server, transformers, litestar, uvicorn, llguidance, openai, pytest, httpx"
  if ! "$PY" -c "$IMPORTS" 2>/dev/null && [ -d .gpu/wheels ]; then
    step "installing mlxcel's requirements from .gpu/wheels"
    timeout 240 "$PY" -m pip install -q --no-index --find-links .gpu/wheels --disable-pip-version-check \
      -r .gpu/requirements.txt || { echo "install from .gpu/wheels failed"; return 1; }
  fi
  "$PY" -c "$IMPORTS" \
    || { echo "mlxcel or a requirement does not import (run scripts/bench/gpu_prepare.py here first)"; return 1; }
  "$PY" -c "from importlib.metadata import version as v; print('transformers', v('transformers'), 'litestar', v('litestar'))"

  step "model"
  if [ -f "$MLXCEL_MODELS_DIR/$MODEL/config.json" ]; then
    echo "$MODEL: the real weights in $MLXCEL_MODELS_DIR"
  elif [ -f .gpu/model/config.json ]; then
    MODEL=mlxcel-fixtures/smollm2-random-twin
    export MLXCEL_MODELS_DIR=/tmp/mlxcel-models
    timeout 120 "$PY" -m scripts.fixtures.build_random_twin .gpu/model "$MLXCEL_MODELS_DIR/$MODEL" \
      || { echo "could not build the random twin"; return 1; }
    echo "$MODEL: random weights with SmolLM2-135M's config and tokenizer (the smoke tests' word checks skip)"
  else
    echo "no model: neither $MLXCEL_MODELS_DIR/$MODEL nor .gpu/model (scripts/bench/gpu_prepare.py)"; return 1
  fi

  step "torch e2e smoke on $DEVICE"
  MLXCEL_TEST_DEVICE=$DEVICE MLXCEL_TEST_MODEL=$MODEL timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/e2e/test_torch_smoke.py
  SMOKE=$?

  step "MLX-quantized weights on $DEVICE (packed, dequantized a chunk at a time; no MLX needed)"
  MLXCEL_TEST_DEVICE=$DEVICE timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/models/test_torch_quantized_device.py
  QUANT=$?
  [ "$SMOKE" -ne 0 ] || SMOKE=$QUANT

  step "decode benchmark (SmolLM2-135M shapes, backend interface, $DEVICE)"
  for dtype in bfloat16 float16 float32; do
    timeout 90 "$PY" -m scripts.bench.decode_bench --backend torch --device "$DEVICE" --dtype "$dtype" --steps 128 \
      -m "$MLXCEL_MODELS_DIR/$MODEL" 2>/dev/null | tail -1
  done

  step "serving benchmark (HTTP, streamed chat, 64 tokens a request, $DEVICE)"
  timeout 150 "$PY" -m scripts.bench.serve_bench --launch --models-dir "$MLXCEL_MODELS_DIR" --model "$MODEL" \
    --mlxcel-backend torch --skip-mlx-lm --concurrency 1 8 --rounds 2 \
    --mlxcel-arg=--device --mlxcel-arg="$DEVICE" --mlxcel-arg=--ignore-eos --mlxcel-arg=-np --mlxcel-arg=8 2>&1 | tail -12

  step "done: smoke and quantized tests exit $SMOKE"
  return $SMOKE
}

if [ -n "${OUT:-}" ]; then  # the device tool brings back what lands in $OUT
  check 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
check
