#!/bin/bash
# One device call (~5-8 minutes): the full compiled Llama-3.1-8B step (BS=1, SEQ=512) with FORGE on the shipped
# tuned-config table and on a candidate table, in the same call, torch fused AdamW as the baseline. The candidate
# (for example benchmarks/tune_shapes.py's output) goes in a user table directory, whose entries win over the
# shipped table's on the keys both hold (kernels/tuned.py); the shipped run gets an empty user directory.
#   NEW_TABLE=path/to/table.json bash benchmarks/e2e_table_ab.sh OUTDIR
# METHODS_OLD / METHODS_NEW choose the methods of each half; BUDGET is each bench's --time-budget (s).
# OLD_TREE (default: this tree) runs the shipped half on another tree's code, e.g. a kernel before a change
# unpacked from `git archive REV | gzip > build/pre.tar.gz` (then OLD_TREE=/tmp/pre after unpacking it there).
set -u
OUTD=$(realpath -m "${1:-${OUT:-/tmp/e2e-table-ab}}")
: "${NEW_TABLE:?set NEW_TABLE to the candidate table (tune_shapes.py --out)}"
mkdir -p "$OUTD"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NAME=$(python3 -c "import torch; from forge_optim.kernels import tuned; print(tuned.table_name(torch.cuda.get_device_name()))")
EMPTY=$(mktemp -d) NEW=$(mktemp -d)
cp "$NEW_TABLE" "$NEW/$NAME"
bench() {
  python3 -m forge_optim.cli.main bench --device cuda --model Llama-3.1-8B --batch-size 1 --seq-len 512 --compile \
    --steps 10 --warmup 5 --profile-steps 2 --timeline-methods '' --no-plots --time-budget ${BUDGET:-300} \
    --method-timeout 170 "$@" 2>&1 | grep -v "Warning\|warnings.warn"
}
(cd "${OLD_TREE:-.}" && FORGE_TUNED_DIR=$EMPTY bench --methods ${METHODS_OLD:-forge-bf16,torch-fused-adamw} \
  --out "$OUTD/shipped") | tee "$OUTD/shipped.log" | tail -8
FORGE_TUNED_DIR=$NEW bench --methods ${METHODS_NEW:-forge-bf16} --out "$OUTD/candidate" \
  | tee "$OUTD/candidate.log" | tail -8
