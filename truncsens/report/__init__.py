"""Reports: the table renderer, printed reports, summaries, policy comparisons and figures.

May import: budget, fits, results and the math modules; never the engine, certificates, api or cli.
"""
