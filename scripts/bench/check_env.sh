# The setting both device checks (gpu_check.sh, dist_check.sh) start from; sourced, not run.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
START=$(date +%s)
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MLXCEL_MODELS_DIR=${MLXCEL_MODELS_DIR:-$PWD/models}
MODEL=HuggingFaceTB/SmolLM2-135M-Instruct
step() { echo; echo "== $* ($(( $(date +%s) - START ))s)"; }
