"""The GPU family: idle GPU, the math path, clocks, launch-bound kernels, host-device syncs."""
