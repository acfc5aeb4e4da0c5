#!/bin/bash
# The compiled Llama-3.1-8B step (BS=1, SEQ=512) under torch.compile mode="reduce-overhead" (CUDA graphs) with
# the shipped H100 table, whose large bf16-state weights name the Gluon ping-pong kernel: that its launches
# (host-built TMA descriptors, PingPongPlan re-launches) capture and replay, and what graphs do to the
# per-step host gap; `none`, forge-bf16 and torch fused AdamW in the same call (~5 minutes).
#   bash benchmarks/pp_graphs.sh OUTDIR
set -u
OUTD=$(realpath -m "${1:-${OUT:-/tmp/pp-graphs}}")
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUTD/smi.txt"
python3 -m forge_optim.cli.main bench --device cuda --model Llama-3.1-8B --batch-size 1 --seq-len 512 --compile \
  --compile-mode reduce-overhead --steps 10 --warmup 5 --profile-steps 2 --timeline-methods '' --no-plots \
  --time-budget ${BUDGET:-420} --method-timeout 200 --methods ${METHODS:-none,forge-bf16,torch-fused-adamw} \
  --out "$OUTD/reduce-overhead" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUTD/reduce-overhead.log" | tail -12
