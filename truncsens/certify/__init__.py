"""``truncsens certify``: error certificates of certainty-plus-Poisson eviction, measured.

Modules: :mod:`~truncsens.certify.estimator` (pure math of one query's records),
:mod:`~truncsens.certify.probe` (the attention function that records them inside a model),
:mod:`~truncsens.certify.passes` (prefill, reference and evicted decodes of a batch of targets),
:mod:`~truncsens.certify.statistics` (coverage, Spearman, relative errors with document bootstrap),
:mod:`~truncsens.certify.eprocess` (time-uniform validity), :mod:`~truncsens.certify.config` and
:mod:`~truncsens.certify.run` (the run), :mod:`~truncsens.certify.report` (printed summary, plots);
attribution of task failures (``truncsens certify-attribution``): :mod:`~truncsens.certify.tasks`,
:mod:`~truncsens.certify.attribution`, :mod:`~truncsens.certify.attribution_report`,
:mod:`~truncsens.certify.attribution_run`, :mod:`~truncsens.certify.trajectory`.
Source: P. Xie, arXiv 2607.21475; docs/method.md sections 5 and 6.
"""
