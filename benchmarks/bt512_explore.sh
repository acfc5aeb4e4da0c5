#!/bin/bash
# BT=512 exploratory configs on the device, in one call (~4-9 minutes): the GPU bit-identity tests of every
# prefetch, evict-first, lookahead and load-fence config against its twin without the hint (exploratory ones included;
# TESTS=<pytest -k expression> narrows them), then the whole-weight tuner over
# the default and exploratory BT=512 candidates (FORGE_TUNE_EXPLORE=1) for Llama-3.1-8B's shapes.
#   bash benchmarks/bt512_explore.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/bt512-explore}}
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > "$OUTD/versions.txt"
if [ "${TEST_BUDGET:-240}" != 0 ]; then  # TEST_BUDGET=0: the whole GPU suite ran just before (it has this test)
  timeout ${TEST_BUDGET:-240} python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_triton_kernel.py \
    -k "${TESTS:-changes_no_bit}" > "$OUTD/gpu-tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUTD/gpu-tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log"
fi
FORGE_TUNE_EXPLORE=1 timeout ${TUNE_BUDGET:-300} python3 benchmarks/tune_shapes.py --bts 512 --modes ${MODES:-bf16,int8} \
  --out "$OUTD/explore-bt512.json" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUTD/explore-bt512.log" | tail -14
