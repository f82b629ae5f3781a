#!/usr/bin/env bash
# The GPU checks in one go, for a machine with CUDA and a torch that sees it:
#   bash benchmarks/gpu_check.sh            (uses python3; PYTHON=... to pick another)
# Runs the `gpu`-marked tests (if pytest is importable; they include one NCCL rank under
# torchrun with per-ubatch communicators), the MoE example on NCCL, then the benchmarks'
# CUDA rows.
# Runs from the checkout without installing it; a few minutes in all.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
if "$PYTHON" -c "import pytest, pytest_timeout" 2>/dev/null; then
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests || status=1
else
    echo "pytest / pytest-timeout not importable: skipping the gpu-marked tests"
fi
# The MoE example on one NCCL rank (CUDA tensors through dispatch/combine, under DBO).
timeout 180 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
    examples/moe_overlap.py --steps 5 || status=1
timeout 120 "$PYTHON" benchmarks/workspace_alloc.py --rounds 5 || status=1
timeout 240 "$PYTHON" benchmarks/overlap_efficiency.py --device cuda --rounds 5 || status=1
exit $status
