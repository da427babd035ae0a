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
# Reproduces the figures of docs/fit.md and docs/policies.md from the commands' results files in the repository's `results/`
# folder, wherever the notebook is started from. Open it with Jupyter (`pip install jupyter jupytext`,
# then `jupytext --to notebook notebooks/reference_truncation.py` and open the `.ipynb`), or run it as a
# script: `python notebooks/reference_truncation.py`. If a window results file is missing, the first
# cell says so and measures it (about 2 minutes per domain on 2 idle CPU cores). The policy section
# needs docs/policies.md's two streaming runs (`results/stream-a.nc`, `results/stream-b.nc`, about an hour);
# without them it says so and is skipped.

# %%
from truncsens.api.notebook import ensure_results, repo_root

RESULTS = repo_root(globals().get("__file__")) / "results"
code, nl = (ensure_results(RESULTS / f"reference-{d}.nc", ["truncsens", "measure", "--domain", d]) for d in ("code", "nl"))
policies = [RESULTS / "stream-a.nc", RESULTS / "stream-b.nc"]  # docs/policies.md's two streaming runs (about 1 hour)

# %% [markdown]
# ## Mean divergence per window, and the fitted decay laws

# %%
from truncsens.fit.fitting import FitConfig, fit_results
from truncsens.report.plots import plot_report
from truncsens.report.printed import format_fit_report

report = fit_results([code, nl], FitConfig(metrics=("tv", "kl")))
doc = report.to_json()
print(format_fit_report(doc))
print(plot_report(doc, RESULTS / "reference-fit"))

# %% [markdown]
# ## Window budgets w(ε) = (C/ε)^(1/α)

# %%
from truncsens.budget.recommend import recommend
from truncsens.report.printed import format_recommendations

print(format_recommendations(recommend(doc, [0.01, 0.05], metric="tv")))

# %% [markdown]
# ## Retention policies at equal budget (streaming semantics)

# %%
missing = [str(p) for p in policies if not p.exists()]
if missing:
    print(f"skipped: {', '.join(missing)} not found; docs/policies.md gives the two "
          "truncsens measure --semantics streaming commands that write them")
else:
    from truncsens.report.plots import plot_comparison
    from truncsens.report.policy_comparison import CompareConfig, compare_policies_file
    from truncsens.report.printed import format_comparison

    cmp = compare_policies_file(policies, CompareConfig(metrics=("kl",)), code)
    print(format_comparison(cmp))
    print(plot_comparison(cmp, RESULTS / "reference-policies"))
