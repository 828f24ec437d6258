"""`--fix`: the pure decisions (plan/, judge layer) and the processes that carry them out (run/, present layer)."""
