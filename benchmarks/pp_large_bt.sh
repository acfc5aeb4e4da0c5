#!/bin/bash
# One device call (~5 minutes on a Hopper machine): do 128x128 ping-pong tiles (one warpgroup per consumer, a 128-row
# accumulator; one tile's W/states in shared memory, `state_slots=1`) hide the AdamW epilogue under the other
# consumer's mainloop at large BT, where the Triton 128x256 tile runs its epilogue after its mainloop (BT=8192:
# 1.20-1.37x cuBLAS's wgrad alone on an H100, NOTES thirty-fifth session)? Every schedule's bytes are checked against
# the Triton reference tile first (pp_sweep.py --check-bits), and cuBLAS's dY.t() @ X is timed in each row (--wgrad).
#   bash benchmarks/pp_large_bt.sh OUTDIR
set -u
OUTD=$(realpath -m "${1:-${OUT:-/tmp/pp-large-bt}}")
source "$(dirname "$0")/device_preamble.sh" "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
C128="BM=128,BN=128,epi_n=8,stages=4,state_slots=1;BM=128,BN=128,epi_n=8,stages=4,state_slots=1,group_size=16"
C128="$C128;BM=128,BN=128,epi_n=16,stages=4,state_slots=1"
C128="$C128;BM=128,BN=128,BK=32,epi_n=8,stages=8,state_slots=1"
CONFIGS=${CONFIGS:-"$C128;BN=128,epi_n=4,stages=5,group_size=16"}
sweep() {  # DIR BUDGET SHAPES BTS: pp_sweep.py into $OUTD/DIR (pp_sweep.json, sweep.log)
  mkdir -p "$OUTD/$1"
  OUT="$OUTD/$1" timeout $2 python3 benchmarks/pp_sweep.py --shapes $3 --bts $4 --configs "$CONFIGS" --check-bits --wgrad \
    2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUTD/$1/sweep.log" | grep -E "BT=|wrote"
}
sweep bt8192 ${SWEEP_BUDGET:-330} ${SHAPES:-14336x4096,4096x14336,4096x4096,1024x4096,128256x4096} ${BTS:-8192}
sweep bt2048-4096 ${SWEEP2_BUDGET:-150} ${SHAPES2:-14336x4096,4096x14336} ${BTS2:-2048,4096}
