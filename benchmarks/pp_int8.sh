#!/bin/bash
# The ping-pong kernel's int8 path, in one device call (~3-5 minutes): its GPU bit tests against the Triton kernel
# (test_gpu_pingpong_int8_writes_the_triton_kernels_bits, with the rest of test_pingpong_kernel.py), then, only if
# they pass, pp_sweep.py with int8 states (pingpong.INT8_CONFIGS against the 16-warp int8 tiles) at BT=512.
#   bash benchmarks/pp_int8.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/pp-int8}}
source "$(dirname "$0")/pp_gpu_tests.sh"
if [ $PP_TESTS_RC != 0 ]; then echo "int8 ping-pong not validated: no sweep"; exit 1; fi
OUT="$OUTD" timeout ${SWEEP_BUDGET:-240} python3 benchmarks/pp_sweep.py --modes int8 \
  --shapes ${SHAPES:-4096x4096,14336x4096,4096x14336,128256x4096} 2>&1 | grep -v "warnings.warn\|Warning"
