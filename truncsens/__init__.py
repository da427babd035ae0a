"""truncsens: truncation sensitivity of causal language models and KV-cache budgets.

Data flows one way: corpus -> documents -> targets -> engine (model + policy) ->
per-target metrics -> results file -> fit -> recommendation / plots.
"""

__version__ = "0.1.0"
