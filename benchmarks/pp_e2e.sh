#!/bin/bash
# One device call (~6-8 minutes): the ping-pong GPU tests, then the compiled Llama-3.1-8B step (BS=1, SEQ=512)
# with the shipped table (which names the Gluon ping-pong kernel for the large bf16-state weights) and, in the
# same call, forge-bf16 with OLD_TABLE as a user table (its entries override the shipped ones: the Triton
# tiles alone), torch fused AdamW and `none` as the baselines.
#   OLD_TABLE=build/old-h100.json [SEQ=512] [METHODS=...] [TEST_BUDGET=200] bash benchmarks/pp_e2e.sh OUTDIR
set -u
source "$(dirname "$0")/device_preamble.sh" "${1:-${OUT:-/tmp/pp-e2e}}"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUTD/smi.txt"
if [ "${TEST_BUDGET:-200}" != 0 ]; then
  timeout ${TEST_BUDGET:-200} python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_pingpong_kernel.py \
    tests/test_tuned_table.py > "$OUTD/gpu-tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUTD/gpu-tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log"
fi
EMPTY=$(mktemp -d) OLD=$(mktemp -d)
NAME=$(python3 -c "import torch; from forge_optim.kernels import tuned; print(tuned.table_name(torch.cuda.get_device_name()))")
FORGE_TUNED_DIR=$EMPTY compiled_bench pingpong ${METHODS:-none,forge-bf16,forge-int8,torch-fused-adamw}
if [ -n "${OLD_TABLE:-}" ]; then
  cp "$OLD_TABLE" "$OLD/$NAME"
  FORGE_TUNED_DIR=$OLD compiled_bench triton-only forge-bf16,torch-fused-adamw
fi
