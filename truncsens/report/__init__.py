"""Reports: the table renderer, printed reports, summaries, policy comparisons and figures."""
