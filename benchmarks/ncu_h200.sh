#!/bin/bash
# Nsight Compute reports of the fused kernel and of the unfused baseline (benchmarks/ncu_fused.py),
# on the H200 (Firecracker runtime: ncu reads the hardware counters there; clocks left alone).
#   bash benchmarks/ncu_h200.sh OUTDIR [case,case,...]
# Writes OUTDIR/ncu.ncu-rep (open in Nsight Compute), OUTDIR/details.txt (speed of light, memory,
# warp stalls, scheduler, occupancy per kernel), OUTDIR/raw.csv (metrics those sections collect) and
# OUTDIR/source.csv (per-SASS-line stall samples of the fused kernels).
set -u
OUTD=${1:-${OUT:-/tmp/ncu}}
CASES=${2:-}
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ncu --version | tail -1
ncu --clock-control none --profile-from-start off --target-processes all \
  --kernel-name regex:'forge_fused_kernel|forge_pingpong_kernel|nvjet|gemm|multi_tensor' \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
  --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
  --import-source no -f -o "$OUTD/ncu" python3 benchmarks/ncu_fused.py $CASES 2>&1 | grep -v "^==PROF== Profiling"
ncu -i "$OUTD/ncu.ncu-rep" --page details > "$OUTD/details.txt" 2>&1
ncu -i "$OUTD/ncu.ncu-rep" --page raw --csv --metrics \
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread \
  > "$OUTD/raw.csv" 2>&1
# per-SASS-line stall samples of every profiled kernel (parsed offline: benchmarks/ncu_sass.py)
ncu -i "$OUTD/ncu.ncu-rep" --page source --csv --print-source sass --kernel-name regex:'forge_fused_kernel|forge_pingpong_kernel' \
  > "$OUTD/source.csv" 2> "$OUTD/source.err"; echo "source page rc=$? $(wc -c < "$OUTD/source.csv") bytes"; head -c 600 "$OUTD/source.err"
grep -n "PROFILED\|forge_fused_kernel\|nvjet\|multi_tensor\|Duration\|Memory Throughput\|DRAM Throughput\|L2 Cache Throughput\|Compute (SM) Throughput\|Achieved Occupancy\|Registers Per Thread\|Stall\|One or More Eligible\|Issued Warp Per Scheduler" "$OUTD/details.txt" | head -300
