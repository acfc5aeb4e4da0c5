"""Triton kernels: the fused weight-gradient GEMM with the optimizer update in its epilogue."""
