"""Run-level facts: the steps and missing evidence, a stopped process."""
