"""The block protocol: K consecutive targets per pass (docs/method.md section 7)."""
