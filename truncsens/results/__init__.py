"""Results: the schema of a results Dataset (:mod:`.schema`), reading and writing it as NetCDF
(:mod:`.files`, with :func:`relabel`, the deliberate change of a file's attrs), exact codecs of strings
and attributes (:mod:`.codec`), the attrs fingerprint checked on load (:mod:`.fingerprint`), joins of runs along
``policy`` (:mod:`.join`), and constructed datasets with exactly known curves (:mod:`.constructed`).

May import: :mod:`truncsens.metrics`, :mod:`truncsens.policies` (names), :mod:`truncsens.models`
(provenance) and the math modules; never the engine, fits, budgets or reports.
"""
from truncsens.results.files import load, relabel, save  # noqa: F401
from truncsens.results.schema import *  # noqa: F401,F403  (the schema's public names)
