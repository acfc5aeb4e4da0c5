#!/bin/bash
# Twenty-fourth session's planned device call (NOTES.md): the int8 epilogue A/B of four trees, main, fence (the
# load fence alone), new (f3b7a4e: the division-free block scale without the fence) and fbs (branch fence-bs:
# both), then the int8 GPU tests on fbs. Build the trees here first (build/ is ignored; carry the tarballs):
#   for t in main:main fence:fence new:f3b7a4e fbs:fence-bs; do git archive ${t#*:} | gzip > build/${t%%:*}.tar.gz; done
#   TOTAL=<seconds for the A/B before the tests> bash benchmarks/fence_ab.sh        (on the device, $OUT set)
# Results are re-packed into $OUT/ab.tgz after every run, so a call cut short still returns what ran.
set -u
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $OUT/gpu.csv 2>&1
for t in main fence new fbs; do mkdir -p /tmp/$t && tar -xzf build/$t.tar.gz -C /tmp/$t; done
mkdir -p /tmp/res
start=$(date +%s)
ab() {  # tree label states
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1/src timeout -k 5 150 python3 benchmarks/epilogue_ab.py --label $2 \
    --out /tmp/res/ab-$2.json --shapes 4096x4096,14336x4096,4096x14336 --states $3 2>&1 \
    | grep -v "Warning\|warnings.warn" >> $OUT/ab.log; echo "$2 rc=${PIPESTATUS[0]} t=$(( $(date +%s) - start ))" \
    | tee -a $OUT/ab.log)
  tar -czf $OUT/ab.tgz -C /tmp/res .
}
ab main main-r1 int8; ab fbs fbs-r1 int8; ab new new-r1 int8; ab fence fence-r1 int8
ab fbs fbs-r2 int8; ab main main-r2 int8
ab main main-r3 bf16; ab fence fence-r3 bf16
left=$(( ${TOTAL:-420} - ($(date +%s) - start) ))
echo "tests with $left s left"
if [ $left -gt 60 ]; then
  (cd /tmp/fbs && PYTHONPATH=/tmp/fbs/src timeout -k 5 $left python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_block_scale.py tests/test_triton_kernel.py -k "int8 or block_scale" 2>&1 | tail -15 > $OUT/gpu-fbs.log)
  tail -4 $OUT/gpu-fbs.log
fi
