#!/bin/bash
# One device call: the GPU test suite on the current code (TESTS, default all of tests/), then, on a GPU
# that has no shipped tuned-config table (kernels/tuned/), the whole-weight table for Llama-3.1-8B's
# shapes (benchmarks/tune_shapes.py, ~70-100 s) so that it can be shipped.
#   [TESTS="tests/a.py tests/b.py"] bash benchmarks/gpu_suite_and_table.sh OUTDIR
# (the whole suite, 79 tests, ran past one 600 s call on a cold H100 on 2026-12-07: split it with TESTS)
set -u
OUTD=${1:-${OUT:-/tmp/gpu-suite}}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUTD"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUTD/gpu.csv" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUTD/versions.txt"
start=$(date +%s)
timeout ${SUITE_TIMEOUT:-420} python3 -m pytest -m gpu -p no:cacheprovider -q -rs ${TESTS:-tests} 2>&1 \
  | tee "$OUTD/gpu-tests.log" | tail -15
echo "suite: $(( $(date +%s) - start )) s"
TABLE=$(python3 -c "import torch; from forge_optim.kernels import tuned; \
p = tuned.table_path(torch.cuda.get_device_name()); print('' if p.exists() else p.name)")
if [ -n "$TABLE" ]; then
  left=$(( ${CALL_BUDGET:-570} - ($(date +%s) - start) ))
  echo "no shipped table ($TABLE); tuning with ${left} s left"
  timeout $left python3 benchmarks/tune_shapes.py --bts ${TUNE_BTS:-512,2048,8192} --out "$OUTD/$TABLE" 2>&1 \
    | tee "$OUTD/tune-shapes.log" | tail -8
fi
