"""Results: the NetCDF schema (:mod:`.schema`), exact codecs of strings and attributes (:mod:`.codec`), joins (:mod:`.join`)."""
from truncsens.results.schema import *  # noqa: F401,F403  (the results file's public functions)
