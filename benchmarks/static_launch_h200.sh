#!/bin/bash
# The static launch on the H200, in one device call (about 6 minutes): its GPU tests (bits equal to
# Triton's launcher), the host cost of one fused update's pieces with either launcher, and the paired
# in-process A/B of an 8-layer Llama-3.1-8B step, compiled and eager, with either launcher.
#   bash benchmarks/static_launch_h200.sh OUTDIR
set -u
OUTD=${1:-${OUT:-/tmp/static-launch}}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FORGE_STATIC_LAUNCH=1
mkdir -p "$OUTD"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUTD/gpu.csv" 2>&1
timeout 150 python3 -m pytest -q -m gpu tests/test_triton_kernel.py -k "static or direct or prepared or bf16_accumulation or thread" 2>&1 \
  | tee "$OUTD/gpu-tests.log" | tail -5
timeout 60 python3 benchmarks/update_host_cost.py --out "$OUTD/update-host-cost.json" 2>&1 | tee "$OUTD/update-host-cost.log" | tail -20
timeout 330 python3 benchmarks/compiled_ab.py --layers 8 --rounds 20 \
  --variants none,new,new-triton,none-eager,eager,eager-triton --out "$OUTD/ab-8l.json" 2>&1 | tee "$OUTD/ab-8l.log" | tail -22
