"""The live judgement: analyses of a running job, its state and what was shown."""
