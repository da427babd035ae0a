# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Error certificates of Poisson eviction on the reference model
#
# Reproduces the certify figures (reliability, certificate against true error, recomputation
# curves) and the attribution tables from the results files of `truncsens certify` and
# `truncsens certify-attribution` in the repository's `results/` folder, wherever the notebook is
# started from. Open it with Jupyter (`pip install jupyter jupytext`, then
# `jupytext --to notebook notebooks/certify.py` and open the `.ipynb`), or run it as a script:
# `python notebooks/certify.py`. A missing results file is measured first (certify: about 5
# minutes, attribution: a few minutes on 2 idle CPU cores).

# %%
import truncsens
from truncsens.api.certify import Certification
from truncsens.api.certify_attribution import Attribution
from truncsens.api.notebook import ensure_results, repo_root, show

RESULTS = repo_root(globals().get("__file__")) / "results"
# the runs of docs/certify.md's commands (certify at N = 1,024; certify-attribution --trajectory 8)
certify_nc = ensure_results(RESULTS / "reference-code-certify.nc", truncsens.certify, domain="code", reference_context=1024)
attribution_nc = ensure_results(RESULTS / "reference-code-attribution.nc", truncsens.certify_attribution, domain="code",
                                trajectory=8)

# %% [markdown]
# ## Coverage and tightness of the per-step certificates (`truncsens certify`)

# %%
certification = Certification.load(certify_nc)
print(certification.table())
show(certification.plot(RESULTS / "reference-code-certify"))

# %% [markdown]
# ## Attribution of failures and gated recomputation (`truncsens certify-attribution`)
#
# With `--trajectory`, the last lines give the e-process of a greedy trajectory under eviction.

# %%
attribution = Attribution.load(attribution_nc)
print(attribution.table())
show([attribution.plot(RESULTS / "reference-code-attribution")])
