#!/usr/bin/env bash
# Negative coverage of check_llama_compat_manifest.py: mutate throwaway copies of the manifest
# and assert each rule rejects them. The cases live in the pytest module, which `make test`
# (and so CI) also runs; this script runs just them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec "$PY" -m pytest -q tests/compat/test_manifest_validator_rejects.py "$@"
