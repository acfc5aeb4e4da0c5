#!/bin/bash
# Issue 4's own setting on the H200, in one device call (about 6 minutes): the full 32-layer Llama-3.1-8B,
# BS=1 SEQ=512, torch.compile'd (default mode): no optimizer, torch fused AdamW, FORGE bf16. Reports the
# synchronized step, the back-to-back step (no synchronize between steps) and GPU time with inductor's
# generated kernels counted (the gpu_activity fix of 2026-12-04 evening). Each method compiles for
# ~100-140 s in its own process.
#   bash benchmarks/e2e_full_compiled_h200.sh OUTDIR     (BENCH_DEVICE=cpu BENCH_MODEL=tiny for a dry run)
set -u
OUTD=${1:-${OUT:-/tmp/e2e-full-compiled}}
MODEL=${BENCH_MODEL:-Llama-3.1-8B}
DEV=${BENCH_DEVICE:-cuda}
BUDGET=${BUDGET:-560}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUTD"
python3 -m forge_optim.cli.bench --device $DEV --model $MODEL --batch-size 1 --seq-len 512 --compile \
  --methods none,torch-fused-adamw,forge-bf16 --steps 10 --warmup 5 --profile-steps 2 --timeline-methods '' \
  --no-plots --time-budget $BUDGET --method-timeout 260 --out-dir "$OUTD"
