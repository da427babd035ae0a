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


def show(paths) -> None:
    """Print the figure paths; display the images too under Jupyter."""
    for path in paths:
        print(path)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is not None:
        for path in paths:
            display(Image(filename=str(path)))


RESULTS = repo_root() / "results"
certify_nc = RESULTS / "reference-code-certify.nc"
attribution_nc = RESULTS / "reference-code-attribution.nc"
for path, command in ((certify_nc, ["truncsens", "certify", "--domain", "code"]),
                      (attribution_nc, ["truncsens", "certify-attribution", "--domain", "code", "--trajectory", "16"])):
    if not path.exists():
        print(f"{path} is missing: measuring it now ({' '.join(command)})")
        subprocess.run([*command, "--out", str(path), "--no-progress"], check=True)

# %% [markdown]
# ## Coverage and tightness of the per-step certificates (`truncsens certify`)

# %%
from truncsens import results
from truncsens.certify.report import format_summary, save_figures, summarize

certify_ds = results.load(certify_nc)
certify_summary = summarize(certify_ds)
print(format_summary(certify_summary))
show(save_figures(certify_ds, certify_summary, RESULTS / "reference-code-certify"))

# %% [markdown]
# ## Attribution of failures and gated recomputation (`truncsens certify-attribution`)
#
# With `--trajectory`, the last lines give the e-process of a greedy trajectory under eviction.

# %%
from truncsens.certify.attribution_report import format_attribution, save_curves, summarize_attribution

attribution_ds = results.load(attribution_nc)
print(format_attribution(summarize_attribution(attribution_ds)))
show([save_curves(attribution_ds, RESULTS / "reference-code-attribution")])
