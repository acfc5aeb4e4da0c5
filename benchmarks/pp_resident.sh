#!/bin/bash
# One device call (~6-8 minutes, Hopper): the ping-pong schedules with dY resident in shared memory
# (pingpong.RESIDENT_CONFIGS, PingPongConfig.dy_resident). First their GPU bit tests (against the Triton kernel:
# ragged K, rows changing inside a program's run, one tile per row, the non-finite guard, the streamed fallback
# above the chunks' tokens); only if they pass, pp_sweep.py --set resident at BT=512 and BT=256 on the four large
# Llama-3.1-8B shapes, beside the tabled two-slot schedules and the Triton tiles of the same run.
#   bash benchmarks/pp_resident.sh OUTDIR
set -u
OUTD=$(realpath -m "${1:-${OUT:-/tmp/pp-resident}}")
source "$(dirname "$0")/device_preamble.sh" "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout ${TEST_BUDGET:-200} python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_pingpong_kernel.py \
  -k "resident or nonfinite" > "$OUTD/gpu-tests.log" 2>&1
rc=$?
echo "pytest rc=$rc" >> "$OUTD/gpu-tests.log"
grep -E "FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log" | tail -20
[ $rc -eq 0 ] || { echo "bit tests did not pass: no sweep"; exit 1; }
SHAPES=${SHAPES:-14336x4096,4096x4096,4096x14336,128256x4096}
for bt in ${BTS:-512 256}; do
  mkdir -p "$OUTD/bt$bt"
  OUT="$OUTD/bt$bt" timeout ${SWEEP_BUDGET:-170} python3 benchmarks/pp_sweep.py --shapes $SHAPES --bts $bt --set resident \
    2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUTD/bt$bt.log" | grep -E "BT=|wrote"
done
