#!/usr/bin/env bash
# One device call: install parity there (gguf from the carried .wheels), then the GPU tests and
# the cuda conformance run; logs under $OUT. Usage on the device: bash benchmarks/gpu_session.sh
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -m parity backends 2>&1 | tail -5
mkdir -p "${OUT:-/tmp/out}"
timeout 400 python3 -m pytest -q --tb=short --maxfail=40 -p no:cacheprovider tests/test_backend_ops.py --backend cuda \
  -k "not numpy" 2>&1 | tee "${OUT:-/tmp/out}/conformance.txt" | tail -40
timeout 300 python3 -m pytest -q --tb=short --maxfail=10 -p no:cacheprovider tests/test_cuda_backend.py \
  2>&1 | tee "${OUT:-/tmp/out}/gpu_tests.txt" | tail -30
