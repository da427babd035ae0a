"""Budgets: windows w(eps), recommendations from a fit, KV-cache bytes.

May import: fits, results and the math below them (docs/architecture.md); never the engine, reports or the CLI.
"""
