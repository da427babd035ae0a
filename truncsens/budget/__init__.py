"""Budgets: windows w(eps), recommendations from a fit, KV-cache bytes."""
