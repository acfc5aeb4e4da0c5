#!/bin/bash
# Sourced by the ping-pong device scripts (pp_int8.sh, pp_slots.sh, pp_h200_sweep.sh): device_preamble.sh (OUTD,
# versions, compiled_bench), then the ping-pong GPU bit tests (tests/test_pingpong_kernel.py, -m gpu) into
# $OUTD/gpu-tests.log. Sets PP_TESTS_RC (0: all passed).
#   OUTD=dir; source benchmarks/pp_gpu_tests.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_preamble.sh" "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout ${TEST_BUDGET:-200} python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_pingpong_kernel.py \
  > "$OUTD/gpu-tests.log" 2>&1
PP_TESTS_RC=$?
echo "pytest rc=$PP_TESTS_RC" >> "$OUTD/gpu-tests.log"
grep -E "FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log"
