#!/bin/bash
# One device call (~8 minutes): the compiled Llama-3.1-8B step (BS=1) with the embedding's row-sparse gradient
# built outside inductor's graph (this tree) against OLD_SRC (a tree whose compiled embedding gradient is dense:
# `git archive 2356797 src | tar -x -C build/old`), same call; then the GPU tests that touch the sparse step and
# the compiled path. Baselines: `none` and torch fused AdamW from this tree.
#   OLD_SRC=build/old/src [SEQS="512 256"] [TEST_BUDGET=180] bash benchmarks/emb_e2e.sh OUTDIR
set -u
OUTD=$(realpath -m "${1:-${OUT:-/tmp/emb-e2e}}")
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1
NEW=$(realpath src) OLD=$(realpath -m "${OLD_SRC:-build/old/src}")
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUTD/versions.txt"
bench() {  # bench SRC SEQ NAME METHODS
  PYTHONPATH=$1 python3 -m forge_optim.cli.main bench --device cuda --model Llama-3.1-8B --batch-size 1 --seq-len $2 \
    --compile --steps 10 --warmup 5 --profile-steps 2 --timeline-methods '' --no-plots --time-budget 300 \
    --method-timeout 170 --methods $4 --out "$OUTD/$3" 2>&1 | grep -v "Warning\|warnings.warn" > "$OUTD/$3.log"
  tail -6 "$OUTD/$3.log"
}
for SEQ in ${SEQS:-512 256}; do
  bench $NEW $SEQ new-$SEQ none,forge-bf16,torch-fused-adamw
  bench $OLD $SEQ old-$SEQ forge-bf16
  bench $NEW $SEQ new2-$SEQ forge-bf16
done
if [ "${TEST_BUDGET:-180}" != 0 ]; then
  PYTHONPATH=$NEW timeout ${TEST_BUDGET:-180} python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
    tests/test_batched_step.py tests/test_gpu_end_to_end.py tests/test_pingpong_kernel.py -k "sparse or compiled or t3" \
    > "$OUTD/gpu-tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUTD/gpu-tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log" | tail -30
fi
