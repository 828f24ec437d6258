"""The ranks family: stragglers, their sync points and waits, the what-if of a scale change."""
