#!/bin/bash
# state_slots (3-6 tiles' W/states in shared memory) for the ping-pong kernel, in one device call (~6 minutes):
# the ping-pong GPU bit tests (which include t3/t4 schedules), then, only if they pass, pp_sweep.py --set slots
# at BT=512 on the Llama-3.1-8B shapes and at BT=256/1024 on two of them.
#   bash benchmarks/pp_slots.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/pp-slots}}
source "$(dirname "$0")/pp_gpu_tests.sh"
if [ $PP_TESTS_RC != 0 ]; then echo "slots not validated: no sweep"; exit 1; fi
mkdir -p "$OUTD/bt512" "$OUTD/bt256-1024"
OUT="$OUTD/bt512" timeout ${SWEEP_BUDGET:-200} python3 benchmarks/pp_sweep.py --set slots \
  --shapes ${SHAPES:-4096x4096,14336x4096,4096x14336,128256x4096} 2>&1 | grep -v "warnings.warn\|Warning"
OUT="$OUTD/bt256-1024" timeout ${SWEEP2_BUDGET:-120} python3 benchmarks/pp_sweep.py --set slots \
  --shapes 4096x4096,14336x4096 --bts 256,1024 2>&1 | grep -v "warnings.warn\|Warning"
