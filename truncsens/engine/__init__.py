"""Forward passes: re-encode batches (and, for retention policies, masked passes).

May import: results, policies, models, corpora, targets, metrics and the math modules; never fits, budgets, reports, certificates, api or cli.
"""
