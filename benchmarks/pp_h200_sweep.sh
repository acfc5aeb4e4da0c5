#!/bin/bash
# One device call (~6-8 minutes) on a Hopper card whose table does not name the ping-pong kernel yet (the H200):
# the ping-pong GPU bit tests, then pp_sweep.py at BT=512 (two-slot schedules) and BT=256 (state-slot schedules)
# on the four large Llama-3.1-8B shapes, each beside the two named Triton tiles and the device's tabled one, then
# pp_table.py into a copy of the device's shipped table ($OUTD/<table>.json: review, then commit it as the
# shipped table, and measure with `OLD_TABLE=<the old one> bash benchmarks/pp_e2e.sh`).
#   bash benchmarks/pp_h200_sweep.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/pp-h200}}
TEST_BUDGET=${TEST_BUDGET:-150} source "$(dirname "$0")/pp_gpu_tests.sh"
SHAPES=${SHAPES:-4096x4096,14336x4096,4096x14336,128256x4096}
mkdir -p "$OUTD/bt512" "$OUTD/bt256"
OUT="$OUTD/bt512" timeout ${SWEEP_BUDGET:-170} python3 benchmarks/pp_sweep.py --shapes $SHAPES --bts 512 2>&1 \
  | grep -v "Warning\|warnings.warn" | tee "$OUTD/bt512.log" | grep -E "BT=|wrote"
OUT="$OUTD/bt256" timeout ${SWEEP_BUDGET:-170} python3 benchmarks/pp_sweep.py --shapes $SHAPES --bts 256 --set slots \
  2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUTD/bt256.log" | grep -E "BT=|wrote"
NAME=$(python3 -c "import torch; from forge_optim.kernels import tuned; print(tuned.table_name(torch.cuda.get_device_name()))")
cp "src/forge_optim/kernels/tuned/$NAME" "$OUTD/$NAME"
SWEEPS=$(ls "$OUTD"/bt512/*.json "$OUTD"/bt256/*.json 2>/dev/null)
[ -n "$SWEEPS" ] && python3 benchmarks/pp_table.py "$OUTD/$NAME" $SWEEPS \
  --why "pp_h200_sweep.sh on $(date -u +%F): ping-pong where it beat the best Triton tile of the same run" | tail -12
