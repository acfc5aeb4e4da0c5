#!/bin/bash
# One device call (~4-6 minutes on a warm machine): the activation-checkpointed rows of issue 5 after the recompute
# fix of 2026-12-07 (autograd.SavedOperands: a checkpoint's recompute no longer re-runs each block's last linear).
#   seq2048: eager Llama-3.1-8B BS=1 SEQ=2048, int8 state (the "fits a 40 GB card" row; H200 2026-12-04 before the
#            fix: FORGE 293.0 ms, 33.99 GiB against fused AdamW 280.5 ms)
#   bs16c:   compiled BS=16 SEQ=512 (eager after the fix on an H100: 0.999x fused AdamW)
#   [PARTS="seq2048 bs16c"] bash benchmarks/ckpt_e2e.sh OUTDIR
set -u
source "$(dirname "$0")/device_preamble.sh" "${1:-${OUT:-/tmp/ckpt-e2e}}"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUTD/smi.txt"
bench() {  # NAME ARGS...: forge-optim bench, Llama-3.1-8B, activation checkpointing, into $OUTD/NAME
  local name=$1; shift
  python3 -m forge_optim.cli.main bench --device cuda --model Llama-3.1-8B --activation-checkpointing \
    --timeline-methods '' --no-plots --out "$OUTD/$name" "$@" 2>&1 | grep -v "Warning\|warnings.warn" > "$OUTD/$name.log"
  grep "status=" "$OUTD/$name.log"
}
for part in ${PARTS:-seq2048 bs16c}; do
  case $part in
    seq2048) bench seq2048 --batch-size 1 --seq-len 2048 --steps 10 --warmup 3 --profile-steps 1 --time-budget 240 \
               --method-timeout 110 --methods forge-int8,torch-fused-adamw ;;
    bs16c) bench bs16c --batch-size 16 --seq-len 512 --compile --steps 6 --warmup 3 --profile-steps 1 --time-budget 330 \
             --method-timeout 160 --methods forge-bf16,torch-fused-adamw ;;
  esac
done
