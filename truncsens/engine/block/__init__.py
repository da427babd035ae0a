"""The block protocol: K consecutive targets per pass (docs/method.md section 7).

May import: the engine modules and what they may import.
"""
