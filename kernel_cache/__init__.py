"""traindx.kernel_cache: precompile FlashAttention-4 kernels into FA4's own persistent cache
(on a GPU, or on a CPU-only machine under FakeTensorMode) and inspect, verify and ship that cache.

`kernel-cache` is the command (cli.py); spec.py says what to compile, warm.py runs the compiler
processes (worker.py), store.py knows FA4's on-disk layout.
"""
