"""A fused RMSNorm in Triton, autotuned, as many training repos carry one."""
