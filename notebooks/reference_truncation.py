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
# Reproduces the README's figures from the commands' results files in the repository's `results/`
# folder, wherever the notebook is started from. Open it with Jupyter (`pip install jupyter jupytext`,
# then `jupytext --to notebook notebooks/reference_truncation.py` and open the `.ipynb`), or run it as a
# script: `python notebooks/reference_truncation.py`. If a results file is missing, the first cell
# says so and measures it (about 2 minutes per domain on 2 idle CPU cores).

# %%
import subprocess
from pathlib import Path


def repo_root() -> Path:
    """The checkout holding this notebook: the first folder upwards (from this file when run as a
    script, from the working directory under Jupyter) with truncsens's pyproject.toml."""
    here = Path(__file__).resolve().parent if "__file__" in globals() else Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "truncsens").is_dir():
            return folder
    raise SystemExit(f"start the notebook inside the truncsens checkout (looked upwards from {here})")


RESULTS = repo_root() / "results"
code, nl, policies = RESULTS / "reference-code.nc", RESULTS / "reference-nl.nc", RESULTS / "reference-code-policies.nc"
for path, domain in ((code, "code"), (nl, "nl")):
    if not path.exists():
        print(f"{path} is missing: measuring it now (truncsens measure --domain {domain}, about 2 minutes)")
        subprocess.run(["truncsens", "measure", "--domain", domain, "--out", str(path), "--no-progress"], check=True)

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
    from truncsens import results
    from truncsens.plots import plot_comparison
    from truncsens.policy_compare import compare_policies
    from truncsens.reports import format_comparison

    cmp = compare_policies(results.load(policies))
    print(format_comparison(cmp))
    print(plot_comparison(cmp, RESULTS / "reference-policies"))
