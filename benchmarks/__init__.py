"""Kernel benchmarks and profiling entry points, apart from the product packages (nothing in
server/, models/ or kernels/ imports them). Run from the repository root on a CUDA host, e.g.
``python -m benchmarks.kernel_bench --out DIR``."""
