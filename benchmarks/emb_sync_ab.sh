#!/bin/bash
# One device call (~5 minutes): compiled Llama-3.1-8B BS=1 (SEQ=512) with this tree's sync-free row-sparse embedding
# step against SYNC_SRC (the same step through coalesce(), which syncs the host: `git archive ff4d493 src | tar -x
# -C build/sync`), torch fused AdamW between them; then the GPU tests of the row-sparse step and the compiled path.
#   SYNC_SRC=build/sync/src [SEQ=512] [TEST_BUDGET=100] bash benchmarks/emb_sync_ab.sh OUTDIR
set -u
OUTD=$(realpath -m "${1:-${OUT:-/tmp/emb-sync}}")
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1
NEW=$(realpath src) SYNC=$(realpath -m "${SYNC_SRC:-build/sync/src}")
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUTD/versions.txt"
bench() {  # bench SRC NAME METHODS
  PYTHONPATH=$1 python3 -m forge_optim.cli.main bench --device cuda --model Llama-3.1-8B --batch-size 1 --seq-len ${SEQ:-512} \
    --compile --steps 10 --warmup 5 --profile-steps 2 --timeline-methods '' --no-plots --time-budget 400 \
    --method-timeout 170 --methods $3 --out "$OUTD/$2" 2>&1 | grep -v "Warning\|warnings.warn" > "$OUTD/$2.log"
  tail -4 "$OUTD/$2.log" | head -2
}
bench $NEW new forge-bf16,torch-fused-adamw
bench $SYNC sync forge-bf16
bench $NEW new2 forge-bf16
if [ "${TEST_BUDGET:-100}" != 0 ]; then
  PYTHONPATH=$NEW timeout ${TEST_BUDGET:-100} python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
    tests/test_batched_step.py tests/test_gpu_end_to_end.py -k "sparse or compiled_fp32" > "$OUTD/gpu-tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUTD/gpu-tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log" | tail -12
fi
