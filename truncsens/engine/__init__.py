"""Forward passes: re-encode batches (and, for retention policies, masked passes)."""
