#!/bin/bash
# The ping-pong kernel's int8 path, in one device call (~3-5 minutes): its GPU bit tests against the Triton kernel
# (test_gpu_pingpong_int8_writes_the_triton_kernels_bits, with the rest of test_pingpong_kernel.py), then, only if
# they pass, pp_sweep.py with int8 states (pingpong.INT8_CONFIGS against the 16-warp int8 tiles) at BT=512.
#   bash benchmarks/pp_int8.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/pp-int8}}
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUTD/versions.txt"
timeout ${TEST_BUDGET:-200} python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_pingpong_kernel.py \
  > "$OUTD/gpu-tests.log" 2>&1
rc=$?
echo "pytest rc=$rc" >> "$OUTD/gpu-tests.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log"
if [ $rc != 0 ]; then echo "int8 ping-pong not validated: no sweep"; exit 1; fi
OUT="$OUTD" timeout ${SWEEP_BUDGET:-240} python3 benchmarks/pp_sweep.py --modes int8 \
  --shapes ${SHAPES:-4096x4096,14336x4096,4096x14336,128256x4096} 2>&1 | grep -v "warnings.warn\|Warning"
