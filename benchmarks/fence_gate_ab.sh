#!/bin/bash
# Twenty-fifth session's planned device call (NOTES.md): the load fence's gate (fused.py: FENCE on tiles of
# at least 128x256) was set from an A/B of three configs. This measures the configs it decided unmeasured:
# 64x128 pf la1 (the H100 table's int8 14336x4096 BT=512 entry; offline its slice loads are split on main, as
# 128x256 la1's were) and 128x128 w8 e4 (the H200 tables' BT=8192 int8 winners; grouped already), with 128x256
# la1 as the control,
# on main (pre = the kernel before the fence), fence (the fence on every tile) and this tree (gated).
# Build the trees here first (build/ is ignored; carry the tarballs):
#   git archive 35a0626 | gzip > build/pre.tar.gz; git archive fence | gzip > build/fence.tar.gz
#   TOTAL=<seconds> bash benchmarks/fence_gate_ab.sh        (on the device, from this tree's root, $OUT set)
# Then, with the time left, the int8 BT=512 re-tune on this tree (bt512_explore.sh, MODES=int8).
set -u
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $OUT/gpu.csv 2>&1
for t in pre fence; do mkdir -p /tmp/$t && tar -xzf build/$t.tar.gz -C /tmp/$t; done
ln -sfn "$PWD" /tmp/gated  # this tree
mkdir -p /tmp/res
start=$(date +%s)
CFGS="128x256x64 w16 s3 g8 p1 e8 tma la1|128x128x64 w8 s4 g8 p1 e4 tma la1|128x128x64 w8 s3 g8 p1 e4 tma|64x128x64 w4 s3 g8 p3 e8 tma r168 pf la1"
ab() {  # tree label bts
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1/src timeout -k 5 200 python3 /tmp/gated/benchmarks/epilogue_ab.py --label $2 \
    --out /tmp/res/ab-$2.json --shapes 4096x4096,14336x4096 --states int8 --bts $3 --configs "$CFGS" 2>&1 \
    | grep -v "Warning\|warnings.warn" >> $OUT/ab.log; echo "$2 rc=${PIPESTATUS[0]} t=$(( $(date +%s) - start ))" \
    | tee -a $OUT/ab.log)
  tar -czf $OUT/ab.tgz -C /tmp/res .
}
# ROUNDS (default "pre gated fence pre") lists the trees in run order; gated is SASS-identical to pre on the
# small tiles and to fence on 128x256 (NOTES.md), so "pre fence pre" answers the gate's question in less time.
declare -A n
for t in ${ROUNDS:-pre gated fence pre}; do n[$t]=$(( ${n[$t]:-0} + 1 )); ab $t $t-r${n[$t]} ${BTS:-512,8192}; done
left=$(( ${TOTAL:-540} - ($(date +%s) - start) ))
echo "re-tune with $left s left"
if [ $left -gt 150 ]; then
  (cd /tmp/gated && TEST_BUDGET=0 TUNE_BUDGET=$(( left - 20 )) MODES=int8 bash benchmarks/bt512_explore.sh $OUT/retune)
fi
