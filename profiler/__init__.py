"""Evidence collection: the launcher, the in-process shim, py-spy and NVML samplers, log parsers."""
