"""Per-layer decay laws for ``truncsens plan``: for each layer l, the power law
``D_l(w) = C_l · w^-α_l`` fitted to that layer's own truncation curve (layer l keeps its sinks and last
w keys, every other layer its full cache), with a percentile bootstrap over documents. Pure numpy.

The fit is that of ``truncsens fit``'s power family (:func:`truncsens.fits.laws.fit_family`): weighted
least squares of log mean D against log w, weights ``(mean/se)^2`` from the document-clustered standard
error (:func:`truncsens.fits.laws.log_weights`); windows whose mean is 0, not finite, or at the float32
noise floor of the metric get weight 0, as in ``truncsens fit`` (:mod:`truncsens.fits.points`; the
windows left out are listed per layer).
Each bootstrap resample draws documents with replacement (:func:`truncsens.stats.resample_weights`),
recomputes the means and standard errors and refits.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from truncsens.fits.laws import FitError, fit_family, log_weights
from truncsens.fits.points import classify_points, usable_mask
from truncsens.stats import doc_sums, percentile_interval, resample_weights, resampled_mean_se


def layer_power_laws(values: np.ndarray, windows: Sequence[int], doc: Sequence[str], n_boot: int = 200,
                     seed: int = 0, level: float = 0.95, metric: str = "kl") -> list[dict]:
    """Power laws per layer.

    Args:
        values: [L, n_targets, W] a metric per layer, target and window.
        windows: the W windows in tokens; doc: [n_targets] document ids.
        n_boot: bootstrap resamples over documents (0: no intervals); seed; level: interval level.
        metric: the metric of ``values`` (picks the noise floor).

    Returns:
        one dict per layer: ``{"layer", "windows", "mean", "se", "C": {"value", "ci"}, "alpha": {"value", "ci"},
        "n_boot_failed", "excluded": {...} (the windows left out, by kind: :meth:`PointClasses.to_json`),
        "status": "ok" | "failed", "reason"}``.
    """
    values = np.asarray(values, dtype=np.float64)
    x = np.asarray(windows, dtype=np.float64)
    out = []
    for layer in range(values.shape[0]):
        sums, counts, _ = doc_sums(values[layer], doc)  # [G, W] each
        mult = resample_weights(sums.shape[0], n_boot, seed + layer)  # [1 + n_boot, G]
        means, ses = resampled_mean_se(mult, sums, counts)  # [1 + n_boot, W] each
        classes = classify_points(x.astype(np.int64), means[0], metric)
        keep = usable_mask(x, means, metric, classes.exact_zero_at)  # [1 + n_boot, W]
        params, failed = [], 0
        for b in range(means.shape[0]):
            y, w = log_weights(means[b], ses[b])
            w = np.where(keep[b], w, 0.0)
            try:
                fit = fit_family("power", x, y, w)
                params.append((fit["C"], fit["alpha"]))
            except FitError as exc:
                if b == 0:
                    out.append({"layer": layer, "windows": x.tolist(), "mean": means[0].tolist(), "se": ses[0].tolist(),
                                "C": None, "alpha": None, "n_boot_failed": 0, "excluded": classes.to_json(),
                                "status": "failed", "reason": str(exc)})
                    break
                failed += 1
        else:
            boot = np.asarray(params[1:]) if len(params) > 1 else np.zeros((0, 2))
            ci = [list(percentile_interval(boot[:, i], level)) if len(boot) else [np.nan, np.nan] for i in range(2)]
            out.append({"layer": layer, "windows": x.tolist(), "mean": means[0].tolist(), "se": ses[0].tolist(),
                        "C": {"value": float(params[0][0]), "ci": [float(v) for v in ci[0]]},
                        "alpha": {"value": float(params[0][1]), "ci": [float(v) for v in ci[1]]},
                        "n_boot_failed": failed, "excluded": classes.to_json(), "status": "ok", "reason": None})
    return out


def floor_window(law: dict) -> int | None:
    """The smallest sweep window from which the mean of every larger window lies at the noise floor of
    the metric or is exactly 0 (``law["excluded"]``, :func:`layer_power_laws`): a layer keeping its sinks
    and this many recent keys loses nothing a float32 forward can tell from rounding. None when the
    largest window's mean lies above the floor (or is infinite or missing).

    Args:
        law: one entry of :func:`layer_power_laws`.
    """
    ex = law["excluded"]
    quiet = set(ex["noise_floor"]) | set(ex["zero"])
    zero_at = ex.get("exact_zero_at")
    window = None
    for w in reversed([int(v) for v in law["windows"]]):
        if w in quiet or (zero_at is not None and w >= zero_at):
            window = w
        else:
            break
    return window
