#!/bin/bash
# The Gluon ping-pong kernel on the current code, in one device call (~5-8 minutes): Nsight Compute on its
# 64x64 (1 and 2 programs/SM) and 64x128 schedules beside the Triton kernel's 16-warp BT=512 tile (why were
# 64x128 tiles 2-2.5x slower per element?), then pingpong_check.py (bits against the Triton kernel, timings
# against the shipped BT=512 tiles).
#   bash benchmarks/pp_probe.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/pp-probe}}
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUTD/versions.txt"
timeout ${NCU_BUDGET:-200} bash benchmarks/ncu_h200.sh "$OUTD/ncu" pp64-bf16-4096,pp64x2-bf16-4096,pp128-bf16-4096,big-bf16-4096 \
  > "$OUTD/ncu.log" 2>&1
echo "ncu rc=$?"; grep -E "PROFILED|Duration|DRAM Throughput|Registers Per|Issued Warp|Error|error" "$OUTD/ncu.log" | head -40
[ -s "$OUTD/ncu/source.csv" ] && python3 benchmarks/ncu_sass.py "$OUTD/ncu/source.csv" > "$OUTD/ncu/sass-summary.txt" 2>&1; tail -40 "$OUTD/ncu/sass-summary.txt" 2>/dev/null
OUT="$OUTD" timeout ${PP_BUDGET:-300} python3 benchmarks/pingpong_check.py ${PP_ARGS:-} 2>&1 | grep -v "warnings.warn\|Warning" | tee "$OUTD/pingpong_check.log" | tail -30
