#!/usr/bin/env bash
# The GPU checks in one run, on a machine with CUDA and a torch that sees it:
#   bash benchmarks/gpu_check.sh OUTDIR       (python3 by default; PYTHON=... picks another)
# Writes OUTDIR/gpu_check.md, gpu_check.json and a log per step; exit status 0 when every
# step passed. The steps and their timeouts (7 minutes in all): benchmarks/gpu_check.py.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/gpu_check.sh OUTDIR [--only STEP,...]" >&2
    exit 2
fi
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_check.py" "$@"
