"""The --fix decisions, pure: which candidates to try for a finding, in which order, the edits and
flags each makes (no file written here: fixing/run makes the copies)."""
