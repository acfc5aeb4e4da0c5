#!/bin/bash
# One device call (~3 minutes on a warm Hopper machine, ~5 cold): does a deeper dY/X ring make the 64x64 two-slot
# ping-pong tile as fast as the tabled 64x128 s5 at BT=512? (NOTES thirty-fourth session: bytes in flight, not stage
# count or L2 bytes, tracked the speed; 64x64x32 s12 -> s16, 96 -> 128 KB, ran -10%.) Every schedule's bytes are
# checked against the Triton reference tile in the same run (pp_sweep.py --check-bits: row["bits_equal"]).
#   bash benchmarks/pp_depth.sh OUTDIR
set -u
OUTD=$(realpath -m "${1:-${OUT:-/tmp/pp-depth}}")
source "$(dirname "$0")/device_preamble.sh" "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
CONFIGS=${CONFIGS:-"BN=128,epi_n=4,stages=5,group_size=16;BN=128,epi_n=4,stages=5;BN=64,epi_n=2,stages=6;BN=64,epi_n=2,stages=8;BN=64,epi_n=2,stages=10;BN=64,epi_n=2,stages=8,state_slots=3;BN=64,BK=32,epi_n=2,stages=16;BN=64,BK=32,epi_n=2,stages=20"}
OUT="$OUTD" timeout ${SWEEP_BUDGET:-400} python3 benchmarks/pp_sweep.py --shapes ${SHAPES:-14336x4096,4096x14336,128256x4096} \
  --bts ${BTS:-512} --configs "$CONFIGS" --check-bits 2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUTD/sweep.log" \
  | grep -E "BT=|wrote"
