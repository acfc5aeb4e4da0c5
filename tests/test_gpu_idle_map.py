"""CPU tests of benchmarks/gpu_idle_map.py's split of a step's chrome trace into GPU-busy time and idle gaps."""
from helpers import load_benchmark

gpu_idle_map = load_benchmark("gpu_idle_map")


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def _trace():
    """A 1000 us step: forward 0-300, backward 300-800 (on autograd thread 2), step 800-1000. Kernel 1 is
    launched in the forward and runs at once; kernel 2 is launched late in backward (the GPU waited 260 us for
    it); kernel 3 was queued before the 10 us gap that precedes it; kernel 4 follows after 2 us."""
    ev = [_x("train_step", "user_annotation", 0, 1000), _x("fwd", "user_annotation", 0, 300),
          _x("bwd", "user_annotation", 300, 500), _x("step", "user_annotation", 800, 200),
          _x("aten::mm", "cpu_op", 100, 50), _x("cudaLaunchKernel", "cuda_runtime", 120, 5, correlation=1),
          _x("gemm", "kernel", 130, 70, tid=7, correlation=1),
          _x("forge_optim::fused_linear_update", "cpu_op", 400, 100, tid=2),
          _x("aten::add", "cpu_op", 410, 20, tid=2),
          _x("cuLaunchKernelEx", "cuda_driver", 420, 5, tid=2, correlation=3),
          _x("cuLaunchKernelEx", "cuda_driver", 430, 5, tid=2, correlation=4),
          _x("cuLaunchKernelEx", "cuda_driver", 450, 5, tid=2, correlation=2),
          _x("forge_pingpong_kernel", "kernel", 460, 140, tid=7, correlation=2),
          _x("add", "kernel", 610, 90, tid=7, correlation=3),
          _x("tail", "kernel", 702, 48, tid=7, correlation=4),
          _x("fwd", "gpu_user_annotation", 130, 600, tid=7)]  # GPU-side annotations are not kernels
    return {"traceEvents": ev}


def test_idle_map_splits_the_span_into_busy_lead_tail_and_gaps():
    m = gpu_idle_map.idle_map(_trace())
    assert m["span_us"] == 1000 and m["kernels"] == 4
    assert m["busy_us"] == 70 + 140 + 90 + 48
    assert m["lead_us"] == 130 and m["tail_us"] == 250
    assert m["n_gaps"] == 2 and m["gaps_us"] == 270
    assert m["small_gaps_us"] == 2  # the 2 us between kernels 3 and 4, under min_gap_us
    assert m["busy_us"] + m["lead_us"] + m["tail_us"] + m["gaps_us"] + m["small_gaps_us"] == m["span_us"]


def test_idle_map_names_the_host_bound_gap_and_the_op_that_launched_late():
    m = gpu_idle_map.idle_map(_trace())
    assert m["idle_by_phase"] == {"bwd": {"host_bound_us": 260.0, "queued_us": 10.0, "gaps": 2}}
    assert m["host_bound_by_op"] == [{"op": "forge_optim::fused_linear_update", "us": 260.0, "gaps": 1}]
    big = m["largest_gaps"][0]
    assert big["gap_us"] == 260 and big["host_bound"] and big["next_kernel"] == "forge_pingpong_kernel"
    assert big["launch_after_idle_us"] == 250
    # the queued one is launched inside aten::add, the innermost op around its launch
    assert m["largest_gaps"][1]["launched_in"] == "aten::add" and not m["largest_gaps"][1]["host_bound"]


def test_idle_map_without_annotations_says_so():
    assert "error" in gpu_idle_map.idle_map({"traceEvents": [_x("k", "kernel", 0, 5)]})
