"""The judge's core: the finding and prescription model, analyzer declarations, cause chains,
savings, the verdict, per-step causes, evidence helpers, rank sampling, the A/B and parity decisions,
and the helpers several families read (frameworks, the GPU window, the host code window)."""
