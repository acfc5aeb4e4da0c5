#!/bin/bash
# The compiled Llama-3.1-8B step (BS=1, SEQ=512) under torch.compile mode="reduce-overhead" (CUDA graphs) with
# the shipped H100 table, whose large bf16-state weights name the Gluon ping-pong kernel: that its launches
# (host-built TMA descriptors, PingPongPlan re-launches) capture and replay, and what graphs do to the
# per-step host gap; `none`, forge-bf16 and torch fused AdamW in the same call (~5 minutes).
#   bash benchmarks/pp_graphs.sh OUTDIR
set -u
source "$(dirname "$0")/device_preamble.sh" "${1:-${OUT:-/tmp/pp-graphs}}"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUTD/smi.txt"
BUDGET=${BUDGET:-420} METHOD_TIMEOUT=${METHOD_TIMEOUT:-200} compiled_bench reduce-overhead \
  ${METHODS:-none,forge-bf16,torch-fused-adamw} src --compile-mode reduce-overhead
