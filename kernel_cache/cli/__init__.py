"""present: `kernel-cache` (warm, ls, verify, pack, unpack, env, clear) and the warm-up engines
that run FA4 and Triton compiles in worker processes."""
