#!/bin/bash
# Issue 5 on the H200, in one device call (about 8 minutes): Llama-3.1-8B BS=1 SEQ=512, eager, every
# method whose package is here (peers travel as wheels in .whl/), then torch.compile'd fused AdamW,
# FORGE bf16 and the no-optimizer floor. The eager phase runs the reference (fused AdamW) again last
# (--repeat-reference): the drift between its two runs is what the run order alone moved. Each phase
# has a time budget; methods not started in time are reported as skipped, and results.json is
# rewritten after every method.
#   bash benchmarks/e2e_h200.sh OUTDIR        (BENCH_DEVICE=cpu BENCH_MODEL=tiny for a dry run)
set -u
OUTD=${1:-${OUT:-/tmp/e2e}}
MODEL=${BENCH_MODEL:-Llama-3.1-8B}
DEV=${BENCH_DEVICE:-cuda}
EAGER_BUDGET=${EAGER_BUDGET:-270}
TOTAL_BUDGET=${TOTAL_BUDGET:-545}  # compiled forge needs ~90-150 s to compile and tune
COMPILE_LAYERS=${COMPILE_LAYERS:-8}
METHODS=${BENCH_METHODS:-none,forge-bf16,torch-fused-adamw,forge-int8,flashoptim-release,optimi-release,bnb-adamw8bit,torchao-adamw8bit,flashoptim}
START=$SECONDS
mkdir -p "$OUTD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,temperature.gpu --format=csv 2>/dev/null
echo "setup $((SECONDS-START)) s"
python3 -m forge_optim.cli.bench --device $DEV --model $MODEL --batch-size 1 --seq-len 512 \
  --methods $METHODS --out-dir "$OUTD/eager" --time-budget $EAGER_BUDGET --method-timeout 100 --repeat-reference
REM=$((TOTAL_BUDGET - (SECONDS - START)))
echo "eager phase done at $((SECONDS-START)) s; compile phase budget $REM s"
python3 -m forge_optim.cli.bench --device $DEV --model $MODEL --layers $COMPILE_LAYERS --batch-size 1 --seq-len 512 \
  --compile --methods none,torch-fused-adamw,forge-bf16 \
  --out-dir "$OUTD/compile" --time-budget $REM --method-timeout $REM
echo "all done at $((SECONDS-START)) s"
