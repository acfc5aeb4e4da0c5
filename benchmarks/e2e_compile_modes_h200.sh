#!/bin/bash
# Issue 4: torch.compile's default mode against mode="reduce-overhead" (CUDA-graph replays) on the
# 8-layer Llama-3.1-8B of e2e_h200.sh's compile phase, BS=1 SEQ=512, for none, fused AdamW and FORGE
# bf16, in one device call. FORGE's two ops are tagged cudagraph_unsafe, so reduce-overhead graphs the
# code between them (inductor's graph partitions) and runs them eagerly.
#   bash benchmarks/e2e_compile_modes_h200.sh OUTDIR     (BENCH_DEVICE=cpu BENCH_MODEL=tiny: a dry run)
set -u
OUTD=${1:-${OUT:-/tmp/e2e-modes}}
MODEL=${BENCH_MODEL:-Llama-3.1-8B}
DEV=${BENCH_DEVICE:-cuda}
LAYERS=${COMPILE_LAYERS:-8}
BUDGET=${MODE_BUDGET:-260}
METHODS=${BENCH_METHODS:-none,torch-fused-adamw,forge-bf16}
START=$SECONDS
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUTD"
for MODE in default reduce-overhead; do
  python3 -m forge_optim.cli.bench --device $DEV --model $MODEL --layers $LAYERS --batch-size 1 --seq-len 512 \
    --compile --compile-mode $MODE --methods $METHODS --steps ${STEPS:-15} --warmup ${WARMUP:-5} \
    --profile-steps 2 --timeline-methods '' --no-plots \
    --out-dir "$OUTD/$MODE" --time-budget $BUDGET --method-timeout $BUDGET
  echo "$MODE done at $((SECONDS-START)) s"
done
