#!/bin/bash
# One device call (~6 minutes, Hopper): is the ping-pong relaunch's host path what spreads the synchronized
# compiled step (NOTES thirty-first session)? (1) the GPU tests of the plan's re-launch, both ways (relaunch,
# EncodedRelaunch) and the CPU argument test; (2) host time per launch: pingpong.launch, relaunch,
# EncodedRelaunch (update_host_cost.py --pingpong, bits checked first); (3) compiled Llama-3.1-8B BS=1 SEQ=512,
# forge-bf16 with FORGE_PP_ENCODED=0 and =1 around torch fused AdamW.
#   [ROUNDS=1] bash benchmarks/pp_host.sh OUTDIR
set -u
source "$(dirname "$0")/device_preamble.sh" "$@"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
timeout 150 python3 -m pytest -q -rA -p no:cacheprovider tests/test_pingpong_kernel.py -k "tabled or encoded" \
  > "$OUTD/gpu-tests.log" 2>&1
echo "pytest rc=$?" >> "$OUTD/gpu-tests.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUTD/gpu-tests.log" | tail -6
timeout 120 python3 benchmarks/update_host_cost.py --pingpong --out "$OUTD/pp-host-cost.json" 2>&1 | grep -v "Warning\|warnings.warn"
FORGE_PP_ENCODED=0 compiled_bench relaunch forge-bf16,torch-fused-adamw
FORGE_PP_ENCODED=1 compiled_bench encoded forge-bf16
if [ "${ROUNDS:-2}" -ge 2 ]; then  # ROUNDS=1 when device time is short
  FORGE_PP_ENCODED=0 compiled_bench relaunch2 forge-bf16
  FORGE_PP_ENCODED=1 compiled_bench encoded2 forge-bf16
fi
