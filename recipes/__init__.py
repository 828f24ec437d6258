"""Recipe cards (schema, reference cards as data), throughput, MFU, step-time CV, A/B statistics
and the loss-parity (convergence) check."""
