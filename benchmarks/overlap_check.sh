#!/bin/bash
# overlap_updates (fused updates on a side CUDA stream) on the device, in one call (~5 minutes):
# 1. the GPU tests of the side stream (bits equal to one stream: eager, accumulation, reused weight,
#    compiled, state_dict) and the GPU end-to-end tests;
# 2. the paired 8-layer compiled A/B (benchmarks/compiled_ab.py): one stream vs side stream, with the
#    persistent grid and with one program per tile (FORGE_UPDATE_GRID's two values), and the floor.
#   bash benchmarks/overlap_check.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/overlap}}
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUTD/gpu.csv" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > "$OUTD/versions.txt"
timeout ${TEST_BUDGET:-200} python3 -m pytest -q -rA -m gpu -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} tests/test_overlap.py \
  tests/test_gpu_end_to_end.py 2>&1 | tail -40 > "$OUTD/gpu-tests.log"
cat "$OUTD/gpu-tests.log"
timeout ${AB_BUDGET:-330} python3 benchmarks/compiled_ab.py --layers ${LAYERS:-8} --rounds ${ROUNDS:-15} \
  --variants ${VARIANTS:-none,new,new-side,new-side-tiles,new-tiles} --out "$OUTD/ab-8l.json" 2>&1 | tail -25 | tee "$OUTD/ab-8l.log"
