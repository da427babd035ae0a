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
import truncsens
from truncsens.api.notebook import ensure_results, repo_root

RESULTS = repo_root(globals().get("__file__")) / "results"
code, nl = (ensure_results(RESULTS / f"reference-{d}.nc", truncsens.measure, domain=d) for d in ("code", "nl"))
policies = [RESULTS / "stream-a.nc", RESULTS / "stream-b.nc"]  # docs/policies.md's two streaming runs (about 1 hour)

# %% [markdown]
# ## Mean divergence per window, and the fitted decay laws

# %%
report = truncsens.fit([code, nl], metrics=("tv", "kl"))
print(report.table())
print(report.plot(RESULTS / "reference-fit"))

# %% [markdown]
# ## Window budgets w(ε) = (C/ε)^(1/α)

# %%
from truncsens.report.printed import format_recommendations

print(format_recommendations(truncsens.recommend_window(report, [0.01, 0.05], metrics="tv")))

# %% [markdown]
# ## Retention policies at equal budget (streaming semantics)

# %%
missing = [str(p) for p in policies if not p.exists()]
if missing:
    print(f"skipped: {', '.join(missing)} not found; docs/policies.md gives the two "
          "truncsens measure --semantics streaming commands that write them")
else:
    from truncsens.report.plots import figure_paths
    from truncsens.report.printed import format_comparison

    cmp = truncsens.compare_policies(policies, metrics="kl", truncation=code, plot_out=RESULTS / "reference-policies",
                                     overwrite=True)
    print(format_comparison(cmp))
    print(figure_paths(RESULTS / "reference-policies"))
