#!/usr/bin/env bash
# The GPU checks in one run, on a machine with CUDA and a torch that sees it:
#   bash benchmarks/gpu_check.sh OUTDIR [--only STEP,...]
# The interpreter: $PYTHON if set, else the first of python3, python, /usr/bin/python3,
# /usr/local/bin/python3 and /opt/conda/bin/python whose torch sees a CUDA device (else
# python3, whose preflight then says there is none); the one used is named on stderr.
# Writes OUTDIR/gpu_check.md, gpu_check.json and a log per step; exit status 0 when every
# step passed or was skipped. The steps and their timeouts (7 minutes in all):
# benchmarks/gpu_check.py. A tested transformers for the generation steps comes as wheels:
# `python benchmarks/gpu_wheels.py` here, then bench-out/gpu-wheels with the checkout.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/gpu_check.sh OUTDIR [--only STEP,...]" >&2
    exit 2
fi
sees_cuda='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    for candidate in python3 python /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python; do
        if command -v "$candidate" > /dev/null 2>&1 \
                && timeout 90 "$candidate" -c "$sees_cuda" > /dev/null 2>&1; then
            PYTHON=$candidate
            break
        fi
    done
fi
echo "gpu_check: using $(command -v "$PYTHON" || echo "$PYTHON") ($("$PYTHON" --version 2>&1))" >&2
exec "$PYTHON" "$(dirname "$0")/gpu_check.py" "$@"
