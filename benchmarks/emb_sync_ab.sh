#!/bin/bash
# One device call (~5 minutes): compiled Llama-3.1-8B BS=1 (SEQ=512) with this tree's sync-free row-sparse embedding
# step against SYNC_SRC (the same step through coalesce(), which syncs the host: `git archive ff4d493 src | tar -x
# -C build/sync`), torch fused AdamW between them; then the GPU tests of the row-sparse step and the compiled path.
#   SYNC_SRC=build/sync/src [SEQ=512] [TEST_BUDGET=100] bash benchmarks/emb_sync_ab.sh OUTDIR
set -u
BUDGET=${BUDGET:-400}
source "$(dirname "$0")/device_preamble.sh" "$@"
compiled_bench new forge-bf16,torch-fused-adamw
compiled_bench sync forge-bf16 "${SYNC_SRC:-build/sync/src}"
compiled_bench new2 forge-bf16
if [ "${TEST_BUDGET:-100}" != 0 ]; then
  PYTHONPATH=src timeout ${TEST_BUDGET:-100} python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
    tests/test_batched_step.py tests/test_gpu_end_to_end.py -k "sparse or compiled_fp32" > "$OUTD/gpu-tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUTD/gpu-tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log" | tail -12
fi
