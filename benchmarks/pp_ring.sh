#!/bin/bash
# The ping-pong kernel's ring of state slices (state_slices) against dY/X stages, in one device call (~6 minutes):
# each schedule of pp_sweep.ring_configs() checked bit for bit against the Triton kernel in its own process
# (pp_ring_check.py, 4096x4096 at BT=512: a crash names one schedule), then pp_sweep.py --set ring
# on the schedules that passed, at BT=512 on the Llama-3.1-8B shapes and at BT=256/1024 on two of them.
# (Its first form, pp_slots.sh at commit 12c3ef0, swept whole-tile state slots.)
#   bash benchmarks/pp_ring.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/pp-ring}}
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUTD/versions.txt"
n=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import pp_sweep; print(len(pp_sweep.ring_configs()))")
ok=""
for i in $(seq 0 $((n - 1))); do
  good=1
  for shape in 4096x4096x512; do
    timeout 90 python3 benchmarks/pp_ring_check.py $i $shape > "$OUTD/check-$i-$shape.log" 2>&1 || good=0
    tail -1 "$OUTD/check-$i-$shape.log" | cut -c1-160
  done
  [ $good = 1 ] && ok="$ok${ok:+,}$i"
done
echo "passed: $ok" | tee "$OUTD/passed.txt"
[ -z "$ok" ] && exit 1
mkdir -p "$OUTD/bt512" "$OUTD/bt256-1024"
OUT="$OUTD/bt512" timeout ${SWEEP_BUDGET:-200} python3 benchmarks/pp_sweep.py --set ring --only "$ok" \
  --shapes ${SHAPES:-4096x4096,14336x4096,4096x14336,128256x4096} 2>&1 | grep -v "warnings.warn\|Warning"
OUT="$OUTD/bt256-1024" timeout ${SWEEP2_BUDGET:-100} python3 benchmarks/pp_sweep.py --set ring --only "$ok" \
  --shapes 4096x4096,14336x4096 --bts 256,1024 2>&1 | grep -v "warnings.warn\|Warning"
