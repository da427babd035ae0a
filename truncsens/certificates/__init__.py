"""``truncsens certify``: error certificates of certainty-plus-Poisson eviction, measured.

Modules: :mod:`~truncsens.certificates.estimator` (pure math of one query's records),
:mod:`~truncsens.certificates.probe` (the attention function that records them inside a model),
:mod:`~truncsens.certificates.passes` (prefill, reference and evicted decodes of a batch of targets),
:mod:`~truncsens.certificates.statistics` (coverage, Spearman, relative errors with document bootstrap),
:mod:`~truncsens.certificates.eprocess` (time-uniform validity), :mod:`~truncsens.certificates.config` and
:mod:`~truncsens.certificates.driver` (the run), :mod:`~truncsens.certificates.coverage_report` (printed summary, plots);
attribution of task failures (``truncsens certify-attribution``): :mod:`~truncsens.certificates.tasks`,
:mod:`~truncsens.certificates.attribution`, :mod:`~truncsens.certificates.attribution_report`,
:mod:`~truncsens.certificates.attribution_driver`, :mod:`~truncsens.certificates.trajectory`.
Source: P. Xie, arXiv 2607.21475; docs/method.md sections 5 and 6.

May import: report, budget, fits, engine, results, policies, models, corpora and the math modules; never api/ or cli/.
"""
