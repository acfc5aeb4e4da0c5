#!/bin/bash
# Twenty-sixth session's second device call (~6-8 minutes): the full compiled Llama-3.1-8B step (BS=1, SEQ=512)
# with int8 state, on the kernel before the load fence (pre = 35a0626, shipped table) and on this tree with the
# int8 BT=512 re-tune of the same session as a user table (its entries win over the shipped table's), torch
# fused AdamW as the baseline, all in one call. Run it right after fence_gate_ab.sh on the same warm machine.
#   RETUNE=<tune_shapes.py --out json> bash benchmarks/e2e_fence_ab.sh OUTDIR
# (build/pre.tar.gz as in fence_gate_ab.sh; /tmp/pre is reused when that call left it.)
set -u
OUTD=${1:-${OUT:-/tmp/e2e-fence-ab}}
: "${RETUNE:?set RETUNE to the re-tune table (tune_shapes.py --out)}"
mkdir -p "$OUTD"
[ -d /tmp/pre/src ] || { mkdir -p /tmp/pre && tar -xzf build/pre.tar.gz -C /tmp/pre; }
export PYTHONUNBUFFERED=1
NAME=$(PYTHONPATH=src python3 -c "import torch; from forge_optim.kernels import tuned; print(tuned.table_name(torch.cuda.get_device_name()))")
EMPTY=$(mktemp -d) NEW=$(mktemp -d)
cp "$RETUNE" "$NEW/$NAME"
bench() {  # tree tuned_dir methods out
  (cd "$1" && FORGE_TUNED_DIR=$2 PYTHONPATH="$1/src" python3 -m forge_optim.cli.main bench --device cuda \
    --model Llama-3.1-8B --batch-size 1 --seq-len 512 --compile --steps 10 --warmup 5 --profile-steps 2 \
    --timeline-methods '' --no-plots --time-budget ${BUDGET:-200} --method-timeout 170 --methods "$3" --out "$4" \
    2>&1 | grep -v "Warning\|warnings.warn" | tee "$4.log" | tail -6)
}
bench "$PWD" "$NEW" ${METHODS_NEW:-forge-int8,torch-fused-adamw} "$OUTD/new"
bench /tmp/pre "$EMPTY" ${METHODS_PRE:-forge-int8} "$OUTD/pre"
