"""GPU correctness run: the @pytest.mark.gpu tests of tests/test_triton_kernel.py (the fused kernel)
and tests/test_gpu_end_to_end.py (the optimizer, eager and compiled, against torch.optim).

    PYTHONPATH=src python benchmarks/check_kernel_gpu.py

First compiles the kernel variants those tests and bench_kernel.py use, in parallel processes
(Triton's on-disk cache then serves them), then runs the GPU tests with pytest (or, where pytest
is not installed, with a minimal built-in runner). The log goes to $OUT/gpu_tests.log when $OUT is
set, else to benchmarks/results/gpu_tests-<date>.log. GPU_TESTS_K=EXPR passes ``-k EXPR`` to pytest
(a shorter run when device time is short).
"""
from __future__ import annotations

import datetime as dt
import importlib
import io
import itertools
import os
import sys
import time
import traceback
import types
from dataclasses import replace
from contextlib import redirect_stdout
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from forge_optim.kernels import fused  # noqa: E402
from forge_optim.kernels.launch import (ALL_TUNED_CONFIGS, GPU_TEST_CONFIG,  # noqa: E402
                                        candidate_configs, precompile)

BF16_STATES = fused.ADAM_STATE_KINDS["bf16"]
INT8_STATES = fused.ADAM_STATE_KINDS["int8"]
FP32_STATES = fused.ADAM_STATE_KINDS["fp32"]


def bench_specs():
    cfgs = list(ALL_TUNED_CONFIGS)
    return [dict(config=c, kinds=k) for c in cfgs for k in (BF16_STATES, INT8_STATES)]


def test_specs():
    cfgs = list(dict.fromkeys(candidate_configs(512) + candidate_configs(4096)))
    specs = [dict(config=c, kinds=FP32_STATES, w_dtype="float32", sr_w=False, sr_s=False) for c in cfgs]
    specs += [dict(config=GPU_TEST_CONFIG, kinds=(0, 0, 0), rule="SGD", sr_w=sr, sr_s=False, nonfinite=False)
              for sr in (True, False)]
    specs += [dict(config=GPU_TEST_CONFIG, kinds=FP32_STATES, w_dtype="float32", sr_w=False, sr_s=False),
              dict(config=GPU_TEST_CONFIG, mode=fused.MODE_ACCUMULATE, in_dtype="float32"),
              dict(config=GPU_TEST_CONFIG, mode=fused.MODE_ACCUMULATE, in_dtype="bfloat16")]
    # tests/test_gpu_end_to_end.py (GPU_TEST_CONFIG forced): fp32 Llama (ieee dot), bf16 Llama with bf16
    # and int8 states; each also steps its unfused parameters by BT=0 launches (no TMA, fp32 buffer)
    no_tma = replace(GPU_TEST_CONFIG, use_tma=False)
    for kinds, w, sr in ((FP32_STATES, "float32", False), (BF16_STATES, "bfloat16", True),
                         (INT8_STATES, "bfloat16", True)):
        for cfg, buf in ((GPU_TEST_CONFIG, False), (no_tma, True)):
            specs.append(dict(config=cfg, kinds=kinds, w_dtype=w, in_dtype=w, sr_w=sr, sr_s=sr, grad_buffer=buf))
    return specs


def _stub_pytest():
    """Enough of pytest for the gpu tests: marks, parametrize, importorskip."""
    mod = types.ModuleType("pytest")

    class _Mark:
        def __getattr__(self, name):
            if name == "parametrize":
                def parametrize(names, values):
                    def deco(fn):
                        fn.__dict__.setdefault("_params", []).insert(0, ([n.strip() for n in names.split(",")],
                                                                          values))
                        return fn
                    return deco
                return parametrize

            def mark(fn):
                fn.__dict__.setdefault("_marks", set()).add(name)
                return fn
            return mark

    mod.mark = _Mark()
    mod.importorskip = importlib.import_module
    mod.skip = lambda msg="": (_ for _ in ()).throw(RuntimeError(msg))
    return mod


def run_without_pytest(log):
    sys.modules["pytest"] = _stub_pytest()
    sys.path.insert(0, str(REPO / "tests"))
    mod = importlib.import_module("test_triton_kernel")
    failures = 0
    for name in dir(mod):
        fn = getattr(mod, name)
        if not (name.startswith("test_gpu") and callable(fn)):
            continue
        params = getattr(fn, "_params", [])
        grids = [[dict(zip(ns, v if isinstance(v, tuple) and len(ns) > 1 else (v,))) for v in vals]
                 for ns, vals in params]
        for combo in itertools.product(*grids) if grids else [()]:
            kw = {}
            for d in combo:
                kw.update(d)
            t0 = time.time()
            buf = io.StringIO()
            try:
                with redirect_stdout(buf):
                    fn(**kw)
                status = "PASSED"
            except Exception:  # noqa: BLE001
                status = "FAILED\n" + traceback.format_exc()
                failures += 1
            log(f"{name}{kw} {status} ({time.time() - t0:.1f}s) {buf.getvalue().strip()}")
            torch.cuda.empty_cache()
    return failures


def main():
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (f"gpu_tests-{dt.date.today().isoformat()}.log" if not os.environ.get("OUT") else "gpu_tests.log")
    fh = open(path, "w")

    def log(line):
        print(line, flush=True)
        fh.write(line + "\n")
        fh.flush()

    log(f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')} {torch.cuda.get_device_name()} "
        f"torch {torch.__version__}")
    t0 = time.time()
    specs = test_specs() + ([] if "--tests-only" in sys.argv else bench_specs())
    for line in precompile(specs):
        log("compiled " + line)
    log(f"precompile of {len(specs)} variants: {time.time() - t0:.0f}s")
    try:
        import pytest  # noqa: F401
        have_pytest = True
    except ImportError:
        have_pytest = False
    if have_pytest:
        import subprocess

        env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-s", "-p", "no:cacheprovider",
                                 "--durations=0", *(["-k", os.environ["GPU_TESTS_K"]] if os.environ.get("GPU_TESTS_K") else []),
                                 str(REPO / "tests" / "test_triton_kernel.py"),
                                 str(REPO / "tests" / "test_gpu_end_to_end.py")], cwd=str(REPO),
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # streamed, so a run cut short still leaves its log
            log(line.rstrip())
        rc = proc.wait()
    else:
        log("pytest not installed: built-in runner")
        rc = 1 if run_without_pytest(log) else 0
    log(f"gpu tests exit code {rc}, {time.time() - t0:.0f}s in all")
    fh.close()
    sys.exit(rc)


if __name__ == "__main__":
    main()
