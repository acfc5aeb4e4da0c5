#!/bin/bash
# One device call (~8 minutes): the compiled Llama-3.1-8B step (BS=1) with the embedding's row-sparse gradient
# built outside inductor's graph (this tree) against OLD_SRC (a tree whose compiled embedding gradient is dense:
# `git archive 2356797 src | tar -x -C build/old`), same call; then the GPU tests that touch the sparse step and
# the compiled path. Baselines: `none` and torch fused AdamW from this tree.
#   OLD_SRC=build/old/src [SEQS="512 256"] [TEST_BUDGET=180] bash benchmarks/emb_e2e.sh OUTDIR
set -u
source "$(dirname "$0")/device_preamble.sh" "$@"
for SEQ in ${SEQS:-512 256}; do
  export SEQ
  compiled_bench new-$SEQ none,forge-bf16,torch-fused-adamw
  compiled_bench old-$SEQ forge-bf16 "${OLD_SRC:-build/old/src}"
  compiled_bench new2-$SEQ forge-bf16
done
if [ "${TEST_BUDGET:-180}" != 0 ]; then
  PYTHONPATH=src timeout ${TEST_BUDGET:-180} python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
    tests/test_batched_step.py tests/test_gpu_end_to_end.py tests/test_pingpong_kernel.py -k "sparse or compiled or t3" \
    > "$OUTD/gpu-tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUTD/gpu-tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log" | tail -30
fi
