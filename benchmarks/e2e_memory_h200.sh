#!/bin/bash
# Issue 5's size targets on the H200, in one device call (~5-9 minutes); run after e2e_h200.sh.
#   1. Llama-3.1-8B, BS=1, SEQ=2048, activation checkpointing: FORGE int8 state peak < 38 GiB.
#   2. Qwen3-14B, BS=1, SEQ=512: FORGE int8 peak <= 0.45x fused AdamW's.
#   3. Qwen3-32B, BS=1, SEQ=512, activation checkpointing: FORGE int8 trains; fused AdamW OOMs.
#   4. Llama-3.1-8B, BS=16, SEQ=512: FORGE bf16 never slower than fused AdamW.
# Few steps (memory is the question; the step time of 1-3 comes with it). Each phase has a budget.
# GPU time is profiled too (2 steps, outside the peak): the lent host's speed moves wall-time ratios by
# up to 25% between calls (2026-12-04: fused AdamW 195 and 243 ms on Qwen3-14B), GPU time does not.
#   bash benchmarks/e2e_memory_h200.sh OUTDIR     (BENCH_DEVICE=cpu BENCH_MODEL=tiny for a dry run)
set -u
OUTD=${1:-${OUT:-/tmp/e2e-mem}}
DEV=${BENCH_DEVICE:-cuda}
START=$SECONDS
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() {  # name budget model args...
  local name=$1 budget=$2 model=$3; shift 3
  [ "$DEV" = cpu ] && model=${BENCH_MODEL:-tiny}
  echo "== $name ($((SECONDS-START)) s)"
  python3 -m forge_optim.cli.bench --device $DEV --model $model --steps 5 --warmup 2 --profile-steps 2 \
    --timeline-methods '' --no-plots --out-dir "$OUTD/$name" --time-budget $budget --method-timeout $budget "$@"
}
run seq2048-ckpt 130 Llama-3.1-8B --batch-size 1 --seq-len 2048 --activation-checkpointing --methods forge-int8,torch-fused-adamw
run qwen14b 150 Qwen3-14B --batch-size 1 --seq-len 512 --methods forge-int8,torch-fused-adamw
run qwen32b 170 Qwen3-32B --batch-size 1 --seq-len 512 --activation-checkpointing --methods forge-int8,torch-fused-adamw
run bs16 140 Llama-3.1-8B --batch-size 16 --seq-len 512 --methods forge-bf16,torch-fused-adamw
echo "all done at $((SECONDS-START)) s"
