# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Truncation sensitivity of the reference model
#
# Reproduces the README's figures from the commands' results files. Run the cells in order (or
# `python notebooks/reference_truncation.py`); the first cell runs the measurements if the results
# files are missing (a few minutes on 2 CPU cores).

# %%
import subprocess
from pathlib import Path

RESULTS = Path("results")
code, nl, policies = RESULTS / "reference-code.nc", RESULTS / "reference-nl.nc", RESULTS / "reference-code-policies.nc"
if not code.exists():
    subprocess.run(["truncsens", "measure", "--domain", "code", "--out", str(code), "--no-progress"], check=True)
if not nl.exists():
    subprocess.run(["truncsens", "measure", "--domain", "nl", "--out", str(nl), "--no-progress"], check=True)

# %% [markdown]
# ## Mean divergence per window, and the fitted decay laws

# %%
from truncsens.fitting import FitConfig, fit_results
from truncsens.plots import plot_report
from truncsens.reports import format_fit_report

report = fit_results([code, nl], FitConfig(metrics=("tv", "kl")))
doc = report.to_json()
print(format_fit_report(doc))
print(plot_report(doc, RESULTS / "reference-fit"))

# %% [markdown]
# ## Window budgets w(ε) = (C/ε)^(1/α)

# %%
from truncsens.recommend import recommend
from truncsens.reports import format_recommendations

print(format_recommendations(recommend(doc, [0.01, 0.05], metric="tv")))

# %% [markdown]
# ## Retention policies at equal budget (streaming semantics)

# %%
if policies.exists():
    import xarray as xr

    from truncsens.plots import plot_comparison
    from truncsens.policy_compare import compare_policies
    from truncsens.reports import format_comparison

    cmp = compare_policies(xr.load_dataset(policies, engine="h5netcdf"))
    print(format_comparison(cmp))
    print(plot_comparison(cmp, RESULTS / "reference-policies"))
