#!/bin/bash
# Sourced by the device scripts that time the compiled Llama-3.1-8B step (emb_e2e.sh, emb_sync_ab.sh, pp_host.sh,
# pp_e2e.sh, pp_graphs.sh) and by pp_gpu_tests.sh: OUTD (from $1, else $OUT), versions.txt, and compiled_bench.
#   source benchmarks/device_preamble.sh "$@"
OUTD=$(realpath -m "${1:-${OUT:-/tmp/forge-device}}")
mkdir -p "$OUTD"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUTD/versions.txt"

# compiled_bench NAME METHODS [SRC [BENCH_ARGS...]]: forge-optim bench, compiled Llama-3.1-8B, BS=1, SEQ (512),
# 5+10 steps, from the tree SRC (default ./src), into $OUTD/NAME/ and $OUTD/NAME.log; prints each method's line.
# BENCH_ARGS are added to the bench's own (e.g. --compile-mode reduce-overhead)
compiled_bench() {
  PYTHONPATH=$(realpath -m "${3:-src}") python3 -m forge_optim.cli.main bench --device cuda --model Llama-3.1-8B \
    --batch-size 1 --seq-len ${SEQ:-512} --compile --steps 10 --warmup 5 --profile-steps 2 --timeline-methods '' \
    --no-plots --time-budget ${BUDGET:-300} --method-timeout ${METHOD_TIMEOUT:-170} --methods $2 --out "$OUTD/$1" \
    "${@:4}" 2>&1 | grep -v "Warning\|warnings.warn" > "$OUTD/$1.log"
  grep "status=" "$OUTD/$1.log"
}
