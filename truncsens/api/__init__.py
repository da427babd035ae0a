"""The Python API: plain functions on in-memory objects (a model object or spec, a list of strings, an
xarray Dataset), which the command line calls (parse, call, print) and which ``truncsens`` exports
(:mod:`truncsens`). Keyword names are the commands' options in snake_case. Nothing is written unless
an output path (``out=``, ``plot_out=``, ``json_out=``) is given.

One module per function: :mod:`~truncsens.api.measure` (``truncsens.measure``),
:mod:`~truncsens.api.fit` (``truncsens.fit``, :class:`~truncsens.api.fit.FitReport`),
:mod:`~truncsens.api.recommend` (``truncsens.recommend_window``), :mod:`~truncsens.api.compare`
(``truncsens.compare_policies``), :mod:`~truncsens.api.plot`, :mod:`~truncsens.api.show`,
:mod:`~truncsens.api.certify`, :mod:`~truncsens.api.certify_attribution`,
:mod:`~truncsens.api.load` (``truncsens.load``: a results file as a Dataset),
:mod:`~truncsens.api.reference` (``truncsens train-reference`` and the reference model's held-out
evaluation); :mod:`~truncsens.api.notebook` holds what the notebooks in ``notebooks/`` share.

Layer: the API may import every layer below the command line (report, certify, budget, fit, engine,
results, policies, models, corpora and the top-level math modules); nothing below imports it.
"""
