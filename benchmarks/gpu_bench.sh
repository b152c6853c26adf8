#!/usr/bin/env bash
# One device call: the cuda backend's correctness (conformance, GPU tests) while llama.cpp's
# CUDA build compiles, then parity beside llama.cpp on synthetic twins of the real models (real
# header, random payload). Carry .wheels (gguf) and .peer (../shared/peers/llamacpp-cuda.sh
# prepare .peer). Logs under $OUT.
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for m in smollm2-135m qwen2.5-coder-0.5b; do
  [ -f /tmp/$m.gguf ] || python3 .peer/twin.py .peer/headers/$m.header.bin /tmp/$m.gguf >/dev/null
done
(bash .peer/llamacpp-cuda.sh build > "$out/lcpp_build.txt" 2>&1; echo "build rc $?" >> "$out/lcpp_build.txt") &
build=$!
echo "== conformance"
timeout 200 python3 -m pytest -q --tb=short --maxfail=20 -p no:cacheprovider tests/test_backend_ops.py \
  --backend cuda -k "not numpy" 2>&1 | tee "$out/conformance.txt" | tail -4
echo "== gpu tests"
timeout 200 python3 -m pytest -q --tb=short --maxfail=10 -p no:cacheprovider tests/test_cuda_backend.py \
  2>&1 | tee "$out/gpu_tests.txt" | tail -4
wait $build; tail -1 "$out/lcpp_build.txt"
for m in smollm2-135m qwen2.5-coder-0.5b; do
  echo "== parity $m"
  timeout 150 python3 -m parity bench --model /tmp/$m.gguf --backend cuda -p 512 -g 128 --json 2>&1 | tail -1
  timeout 150 python3 benchmarks/bench_gpu_steps.py /tmp/$m.gguf --runs 200 --profile 2>&1 | tail -3
  echo "== llama.cpp $m"
  timeout 120 bash .peer/llamacpp-cuda.sh bench /tmp/$m.gguf 2>/dev/null \
    | python3 -c "import json,sys; [print(r['n_prompt'], r['n_gen'], round(r['avg_ts'],1), round(r['stddev_ts'],1)) for r in json.load(sys.stdin)]"
done 2>&1 | tee "$out/bench.txt"
