"""What a certify run's repeated draws and its variance estimates say (``truncsens certify --draws D``,
``--variance``): per layer and head, the mean squared error of ô measured over the run's own draws
against the mean variance estimate over the same draws, and r_EB's coverage with each variance
estimate the file holds. Pure numpy on arrays read from the results Dataset.

With D independent Poisson draws of one target (the same certain set, independent uniforms), the
record's mean squared error is estimated by ``MSE_r = (1/D) Σ_d ‖ô_d − o‖²`` and the variance
estimate's expectation by ``E[V̂]_r = (1/D) Σ_d V̂_d``; V̂ is unbiased for the draw-to-draw MSE of ô
when ``Σ_r E[V̂]_r / Σ_r MSE_r`` is 1 (pooled over the targets of a layer and head). The median over
records of ``E[V̂]_r / MSE_r`` (records with MSE_r > 0) says whether the typical record, not only the
pool, is understated.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from truncsens.certificates.statistics import NEGLIGIBLE_TAIL_MASS, RELIABILITY_DELTAS, coverage, radii_at
from truncsens.report.tables import Column, fmt_num, render_table

DRAW_DIM = "certify_draw"


def draw_check(error: np.ndarray, variance: np.ndarray, has_tail: np.ndarray) -> dict:
    """The variance estimate against the squared error over the run's own draws (module docstring).

    Args:
        error: [target, draw, layer, head] ``‖ô_d − o‖`` (values' units).
        variance: the same shape, ``V̂_d`` (squared units).
        has_tail: [target, layer, head], whether the design had random keys (records without are left out).

    Returns:
        {"draws": D, "n_records", "variance_over_mse": pooled over every record (NaN when the MSE is 0),
        "median_record_ratio": median of E[V̂]_r/MSE_r over records with MSE_r > 0, "by_head":
        {"mse", "mean_variance", "variance_over_mse", "median_record_ratio", "n"}: each [layer][head]
        (NaN: no record, or MSE 0)}.

    Raises:
        ValueError: arrays that are not [target, draw, layer, head] / [target, layer, head] of one shape.
    """
    e, v = np.asarray(error, float), np.asarray(variance, float)
    tail = np.asarray(has_tail) > 0
    if e.ndim != 4 or v.shape != e.shape or tail.shape != (e.shape[0], *e.shape[2:]):
        raise ValueError(f"error and variance must be [target, draw, layer, head] and has_tail [target, layer, head], "
                         f"got {e.shape}, {v.shape}, {tail.shape}")
    mse = np.where(tail, (e ** 2).mean(1), np.nan)  # [target, layer, head] MSE_r
    ev = np.where(tail, v.mean(1), np.nan)  # E[V̂]_r
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # heads without a record: NaN
        pooled_mse, pooled_v = np.nanmean(mse, 0), np.nanmean(ev, 0)  # [layer, head]
        ratio = np.where(pooled_mse > 0, pooled_v / np.where(pooled_mse > 0, pooled_mse, 1.0), np.nan)
        record = np.where(mse > 0, ev / np.where(mse > 0, mse, 1.0), np.nan)  # [target, layer, head]
        median_record = np.nanmedian(record, 0)
        total_mse = float(np.nansum(mse))
        total = float(np.nansum(ev)) / total_mse if total_mse > 0 else math.nan
        median_all = float(np.nanmedian(record)) if np.isfinite(record).any() else math.nan
    listed = lambda a: [[float(x) for x in row] for row in a]  # noqa: E731
    return {"draws": int(e.shape[1]), "n_records": int(tail.sum()), "variance_over_mse": total,
            "median_record_ratio": median_all,
            "by_head": {"mse": listed(pooled_mse), "mean_variance": listed(pooled_v), "variance_over_mse": listed(ratio),
                        "median_record_ratio": listed(median_record), "n": [[int(x) for x in row] for row in tail.sum(0)]}}


def eb_coverage_by_variance(error: np.ndarray, variances: dict[str, np.ndarray], value_range: np.ndarray,
                            n_random: np.ndarray, has_tail: np.ndarray, deltas=RELIABILITY_DELTAS) -> list[dict]:
    """Coverage of r_EB alone (no tolerance) at each δ, with each variance estimate, over every record
    with a random tail; "reaches_nominal" when the Wilson interval reaches 1 − δ (the summary's rule).

    Args:
        error: [...] ``‖ô − o‖``; variances: name -> the same shape, a variance estimate each;
        value_range, n_random: the same shape (B̂ and n of the record); has_tail: the same shape
        (broadcastable), whether the design had random keys.
        deltas: miss probabilities, each in (0, 1).

    Returns:
        per δ {"delta", "nominal", "by_variance": {name: coverage dict with "reaches_nominal"}}.

    Raises:
        ValueError: a δ outside (0, 1).
    """
    e = np.asarray(error, float)
    tail = np.broadcast_to(np.asarray(has_tail) > 0, e.shape)
    out = []
    for d in deltas:
        row = {}
        for name, v in variances.items():
            eb, _ = radii_at(v, value_range, n_random, tail, d)
            c = coverage(e[tail], eb[tail])
            row[name] = {**c, "reaches_nominal": bool(c["n"] and c["ci"][1] >= 1 - d)}
        out.append({"delta": d, "nominal": 1 - d, "by_variance": row})
    return out


def draws_summary(ds, budget: int) -> dict | None:
    """The draw check and r_EB's coverage per variance of poisson at ``budget``; None when the file has
    neither several draws nor a corrected variance (a default run: its summary stays as before).

    Coverage counts every draw of every record when the file has draws (D times the records of draw 0).
    With draws and ``attn_tail_mass``, the draw check is also given apart for records whose tail holds
    less than :data:`~truncsens.certificates.statistics.NEGLIGIBLE_TAIL_MASS` of the full-cache
    attention and for the others (``"draw_check_by_tail_mass"``: name -> {"negligible", "with_mass"}).
    """
    plain = "attn_variance_hajek" in ds
    if DRAW_DIM not in ds.dims and not plain:
        return None
    sel = ds.sel(policy="poisson", budget=budget)
    tail = sel["has_tail"].values  # [target, layer, head]
    name = str(ds.attrs.get("variance", "hajek_bias" if plain else "hajek"))
    out: dict = {"variance": name}
    if DRAW_DIM in ds.dims:
        get = lambda v: sel[v].transpose("target", DRAW_DIM, "layer", "head").values  # noqa: E731
        error, rng, n = get("draw_attn_error"), get("draw_value_range"), get("draw_n_random")
        variances = {name: get("draw_attn_variance")}
        if plain:
            variances["hajek"] = get("draw_attn_variance_hajek")
        out["draw_check"] = {k: draw_check(error, v, tail) for k, v in variances.items()}
        if "attn_tail_mass" in sel:
            mass = sel["attn_tail_mass"].values
            parts = {"negligible": (tail > 0) & (mass < NEGLIGIBLE_TAIL_MASS), "with_mass": (tail > 0) & (mass >= NEGLIGIBLE_TAIL_MASS)}
            out["draw_check_by_tail_mass"] = {k: {part: {x: c[x] for x in ("variance_over_mse", "median_record_ratio", "n_records")}
                                                  for part, m in parts.items() for c in [draw_check(error, v, m)]}
                                              for k, v in variances.items()}
        tail = tail[:, None]
    else:
        error, rng, n = sel["attn_error"].values, sel["value_range"].values, sel["n_random"].values
        variances = {name: sel["attn_variance"].values, "hajek": sel["attn_variance_hajek"].values}
    out["eb_coverage_by_variance"] = eb_coverage_by_variance(error, variances, rng, n, tail)
    return out


def format_draws(budgets: list[dict]) -> list[str]:
    """Printed lines of the :func:`draws_summary` of every budget (none when it is None)."""
    rows, checks = [], []
    for b in budgets:
        s = b.get("draws")
        if not s:
            continue
        for c in s["eb_coverage_by_variance"]:
            for name, cov in c["by_variance"].items():
                rows.append([str(b["budget"]), f"{100 * c['nominal']:g}%", name,
                             f"{100 * cov['rate']:.1f}% [{100 * cov['ci'][0]:.1f}, {100 * cov['ci'][1]:.1f}]",
                             str(cov["n"]), "yes" if cov["reaches_nominal"] else "no"])
        for name, d in (s.get("draw_check") or {}).items():
            split = (s.get("draw_check_by_tail_mass") or {}).get(name)
            checks.append([str(b["budget"]), name, str(d["draws"]), str(d["n_records"]), fmt_num(d["variance_over_mse"], 3),
                           fmt_num(d["median_record_ratio"], 3)]
                          + [x for part in ("negligible", "with_mass") for x in (
                              (str(split[part]["n_records"]), fmt_num(split[part]["variance_over_mse"], 3),
                               fmt_num(split[part]["median_record_ratio"], 3)) if split else ("-", "-", "-"))])
    if not rows:
        return []
    lines = ["", "r_EB alone (no tolerance) with each variance estimate, every record and draw [Wilson]",
             render_table([Column("budget", ">"), Column("nominal", ">"), Column("variance"), Column("coverage", ">"),
                           Column("records", ">"), Column("reaches nominal")], rows)]
    if checks:
        m = fmt_num(NEGLIGIBLE_TAIL_MASS, 2)
        lines += ["", "variance against the squared error over the run's own draws (E[V^]/MSE pooled over records; "
                      "median over records of E[V^]_r/MSE_r), all records and apart by the tail's attention mass; "
                      "per layer and head in --json",
                  render_table([Column("budget", ">"), Column("variance"), Column("draws", ">"), Column("records", ">"),
                                Column("E[V^]/MSE", ">"), Column("median per record", ">"),
                                *(Column(f"{h}, mass {w}", ">") for w in (f"< {m}", f">= {m}")
                                  for h in ("records", "E[V^]/MSE", "median per record"))], checks)]
    return lines
