#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py says what it runs), from the repository root, with the
# project's virtual environment where there is one and the machine's python3 otherwise
# (a GPU machine's image, with its own torch): PYTHON=... chooses another.
#
#   tools/gpu_check.sh                # on a CUDA machine: JSON to $OUT/gpu_check.json
#   tools/gpu_check.sh --cpu          # the same steps on the CPU, tiny sizes
#
# Without a CUDA device (and without --cpu) it prints one line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" tools/gpu_check.py "$@"
