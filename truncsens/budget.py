"""Window budgets: the suffix window w(eps) that keeps distortion under eps, with intervals.

With a fitted power law D(w) = C w^-alpha (arXiv 2605.25085: sliding windows reach distortion eps
with w = Theta(eps^(-1/alpha)) among suffix-only policies) the window is::

    w(eps) = (C / eps)^(1 / alpha)

Its interval is the percentile interval (Efron & Tibshirani 1993) of ``(C_b / eps)^(1/alpha_b)``
over the bootstrap resamples ``b`` of the fit (documents resampled; see :mod:`truncsens.fitting`),
so the dependence between C and alpha is kept. Beside it: the smallest measured window whose mean
D is <= eps, and the log-log interpolated crossing between that window and the one before it.

KV memory per sequence (keys and values, all layers)::

    bytes = 2 * layers * kv_heads * head_dim * bytes_per_element * (w + n_sink)

(For a retention budget sweep the budget k already counts its sinks: bytes use k alone.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from truncsens.fitting import FitConfig, FitError, fit_results, read_fit_file

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
BOUNDED_METRICS = {"tv": 1.0, "js": math.log(2.0)}


def check_eps(eps: float, metric: str = "tv") -> float:
    """Validate a distortion target.

    Raises:
        ValueError: eps not finite, eps <= 0, or above the metric's maximum (1 for tv, log 2 for js).
    """
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"--eps must be a number, got {eps!r}") from None
    if not math.isfinite(eps):
        raise ValueError(f"--eps must be finite, got {eps}")
    if eps <= 0:
        raise ValueError(f"--eps must be > 0 (a distortion target), got {eps}")
    top = BOUNDED_METRICS.get(metric)
    if top is not None and eps > top:
        raise ValueError(f"--eps for {metric} must lie in (0, {top:.6g}] since {metric} never exceeds {top:.6g}; got {eps}")
    return eps


def window_for_eps(C: float, alpha: float, eps: float) -> float:
    """w(eps) = (C / eps)^(1/alpha) in tokens (real-valued; arXiv 2605.25085).

    Raises:
        ValueError: alpha <= 0 or not finite (the law does not decrease), C <= 0, or eps <= 0.
    """
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"the fitted law is not decreasing (alpha = {alpha:.4g} <= 0): no window reaches the target; "
                         "check the fit range and the curve")
    if not (math.isfinite(C) and C > 0):
        raise ValueError(f"the fitted scale C = {C} is not positive")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be > 0 and finite, got {eps}")
    return (C / eps) ** (1.0 / alpha)


def window_samples(C: np.ndarray, alpha: np.ndarray, eps: float) -> np.ndarray:
    """w(eps) for bootstrap samples [B]; +inf where alpha <= 0 (never reached), NaN where undefined."""
    C = np.asarray(C, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    ok = np.isfinite(C) & (C > 0) & np.isfinite(alpha)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        w = np.where(alpha > 0, (C / eps) ** (1.0 / np.where(alpha > 0, alpha, 1.0)), np.inf)
    return np.where(ok, w, np.nan)


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of samples that may hold +inf (NaNs dropped): (lo, hi), inf allowed."""
    s = np.sort(np.asarray(samples, dtype=np.float64))
    s = s[~np.isnan(s)]
    if s.size == 0:
        return (math.nan, math.nan)
    q = (1 - level) / 2
    idx = np.array([q, 1 - q]) * (s.size - 1)
    out = []
    for x in idx:
        lo, hi = int(math.floor(x)), int(math.ceil(x))
        if math.isinf(s[hi]) or math.isinf(s[lo]):
            out.append(float(s[hi]) if x - lo > 0 else float(s[lo]))
        else:
            out.append(float(s[lo] + (s[hi] - s[lo]) * (x - lo)))
    return out[0], out[1]


def measured_window(windows: Sequence[int], means: Sequence[float], eps: float) -> tuple[int | None, float | None]:
    """The smallest measured window whose mean is <= eps, and the crossing interpolated in log-log.

    Args:
        windows: [S] windows (any order); means: [S] mean D (zero / non-finite entries are skipped).

    Returns:
        (window or None if no window reaches eps, crossing or None). The crossing interpolates
        log w linearly in log D between the window found and the previous measured one; it is None
        when the smallest window already reaches eps (eps above the measured range).
    """
    w = np.asarray(windows, dtype=np.float64)
    m = np.asarray(means, dtype=np.float64)
    keep = np.isfinite(m) & (m > 0)
    order = np.argsort(w[keep])
    w, m = w[keep][order], m[keep][order]
    hit = np.nonzero(m <= eps)[0]
    if hit.size == 0:
        return None, None
    i = int(hit[0])
    if i == 0:
        return int(w[0]), None
    lw0, lw1, lm0, lm1 = math.log(w[i - 1]), math.log(w[i]), math.log(m[i - 1]), math.log(m[i])
    t = (math.log(eps) - lm0) / (lm1 - lm0) if lm1 != lm0 else 1.0
    return int(w[i]), float(math.exp(lw0 + t * (lw1 - lw0)))


def kv_bytes_per_sequence(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int, window: int, sinks: int = 0) -> int:
    """KV-cache bytes of one sequence: 2 (K and V) * layers * kv_heads * head_dim * bytes * (w + sinks).

    Raises:
        ValueError: a negative or zero size.
    """
    if min(layers, kv_heads, head_dim, bytes_per_element) <= 0 or window < 0 or sinks < 0:
        raise ValueError("KV sizes must be positive and window/sinks non-negative")
    return 2 * layers * kv_heads * head_dim * bytes_per_element * (int(window) + int(sinks))


@dataclass(frozen=True)
class KVSpec:
    """What one cached token costs: ``layers * kv_heads * head_dim`` elements of K and of V."""

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int
    source: str

    def bytes_for(self, window: int, sinks: int = 0) -> int:
        """:func:`kv_bytes_per_sequence` for this model."""
        return kv_bytes_per_sequence(self.layers, self.kv_heads, self.head_dim, self.bytes_per_element, window, sinks)


def kv_spec_for_model(model: str, dtype: str) -> tuple[KVSpec | None, str]:
    """KV sizes from the model's config when it is known locally: "reference", a checkpoint
    folder, or a hub id whose config is in the local Hugging Face cache (never fetched).

    Returns:
        (spec or None, a note saying where the sizes come from or why they are unknown).
    """
    from transformers import AutoConfig

    from truncsens.models import REFERENCE_DIR

    unknown = f"KV memory not shown: the config of model {model!r} is not available locally"
    if model == "reference":
        path = REFERENCE_DIR
    elif model and Path(model).expanduser().is_dir():
        path = Path(model).expanduser()
    elif model and not model.startswith("synthetic"):  # a hub id: its cached config, if any
        try:
            cfg = AutoConfig.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError):
            return None, unknown
        return _kv_spec(cfg, dtype, f"{model} (cached config)")
    else:
        return None, unknown
    if not (path / "config.json").is_file():
        return None, f"KV memory not shown: no config.json in {path}"
    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        return None, f"KV memory not shown: cannot read {path / 'config.json'} ({exc})"
    return _kv_spec(cfg, dtype, str(path / "config.json"))


def _kv_spec(cfg, dtype: str, source: str) -> tuple[KVSpec | None, str]:
    """:class:`KVSpec` from a transformers config (layers, kv heads, head dim) and a dtype name."""
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads and getattr(cfg, "hidden_size", None) else None)
    nbytes = BYTES_PER_ELEMENT.get(str(dtype))
    if not (layers and kv_heads and head_dim and nbytes):
        return None, f"KV memory not shown: {source} lacks layer/head sizes, or dtype {dtype!r} is unknown"
    return KVSpec(int(layers), int(kv_heads), int(head_dim), int(nbytes), source), (
        f"KV bytes = 2 x {layers} layers x {kv_heads} kv heads x {head_dim} head dim x {nbytes} bytes ({dtype}) x (w + sinks)")


@dataclass
class Recommendation:
    """One w(eps) recommendation (all windows in tokens)."""

    label: str
    results_file: str
    metric: str
    eps: float
    C: float
    alpha: float
    w_law: float
    w_law_ci95: tuple[float, float] | None
    window: int
    measured_window: int | None
    measured_crossing: float | None
    eps_in_measured_range: bool
    n_sink: int
    kv_bytes: int | None = None
    kv_bytes_ci95: tuple[int | None, int | None] | None = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The recommendation as a JSON-safe dict (its fields; non-finite numbers become null)."""
        from truncsens.fitting import sanitize

        return sanitize(dict(self.__dict__))


def _int_or_none(x: float) -> int | None:
    return int(math.ceil(x)) if math.isfinite(x) else None


def recommend(fit_doc: dict, eps_values: Sequence[float], metric: str = "tv", level: float = 0.95) -> list[Recommendation]:
    """w(eps) for every curve of a fit file dict and every eps.

    Args:
        fit_doc: a fit file dict (:func:`truncsens.fitting.read_fit_file` or ``FitReport.to_json()``).
        eps_values: distortion targets in the metric's units.
        metric: which metric's power law to use.

    Returns:
        one :class:`Recommendation` per (curve, eps).

    Raises:
        ValueError: bad eps (:func:`check_eps`), no power fit of ``metric`` in the file, or a
            non-decreasing fit (alpha <= 0).
    """
    eps_values = [check_eps(e, metric) for e in eps_values]
    if not eps_values:
        raise ValueError("give at least one --eps")
    fits = [f for f in fit_doc["fits"] if f["metric"] == metric and f["family"] == "power"]
    if not fits:
        have = sorted({f["metric"] for f in fit_doc["fits"]})
        raise FitError(f"the fit has no power law for metric {metric!r} (it has: {', '.join(have) or 'none'}); "
                       f"refit with --metric {metric}")
    out = []
    for f in fits:
        if f["status"] != "ok":
            raise FitError(f"{f['label']}: the power law for {metric} was not fitted ({f['reason']})")
        curve = fit_doc["curves"][f["curve"]]
        C = f["params"]["C"]["value"]
        alpha = f["params"]["alpha"]["value"]
        C = math.nan if C is None else C
        alpha = math.nan if alpha is None else alpha
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"{f['label']}: the fitted {metric} law is not decreasing (alpha = {alpha:.4g}): "
                             "no window reaches eps; check the curve and the fit range")
        samples = f.get("bootstrap_samples")
        prov = curve.get("provenance", {})
        # a window w keeps n_sink sinks besides; a retention budget k already counts them (design.md)
        sinks = 0 if curve.get("sweep") == "budget" else int(prov.get("n_sink", 0) or 0)
        measured = curve["metrics"][metric]
        valid_w = [w for w, m in zip(measured["window"], measured["mean"]) if m is not None and m > 0]
        valid_m = [m for m in measured["mean"] if m is not None and m > 0]
        context = int(prov.get("max_context", 0) or 0) or int(curve.get("reference_context", 0) or 0)
        kv, kv_note = kv_spec_for_model(str(prov.get("model", "")), str(prov.get("dtype", "")))
        comparison = next((c for c in fit_doc.get("comparisons", []) if c["curve"] == f["curve"] and c["metric"] == metric), None)
        for eps in eps_values:
            w = window_for_eps(C, alpha, eps)
            ci = None
            if samples:
                ci = interval(window_samples(np.array(samples["C"], dtype=float), np.array([np.nan if a is None else a for a in samples["alpha"]], dtype=float), eps), level)
            mw, cross = measured_window(measured["window"], measured["mean"], eps)
            in_range = bool(valid_m) and min(valid_m) <= eps <= max(valid_m)
            rec = Recommendation(f["label"], f["results_file"], metric, eps, C, alpha, w, ci, int(math.ceil(w)), mw, cross,
                                 in_range, sinks)
            if valid_w and w > max(valid_w):
                rec.warnings.append(f"w(eps) = {w:.4g} lies beyond the largest measured window ({max(valid_w)}): "
                                    "this is an extrapolation of the law, not a measurement")
            if valid_w and w < min(valid_w):
                rec.warnings.append(f"w(eps) = {w:.4g} lies below the smallest measured window ({min(valid_w)})")
            if context and w + sinks > context:
                rec.warnings.append(f"w(eps) = {w:.4g} (+{sinks} sinks) exceeds the model's context of {context} tokens: "
                                    "no measurement can support it; eps is not reachable with this model's context")
            if not in_range and valid_m:
                rec.notes.append(f"eps is outside the measured range of mean {metric} [{min(valid_m):.3g}, {max(valid_m):.3g}]")
            if comparison and comparison.get("basis") == "extrapolation" and comparison.get("winner") == "exponential":
                rec.warnings.append("the exponential law extrapolates this curve better than the power law; "
                                    "w(eps) from the power law may be off")
            if kv is not None:
                rec.kv_bytes = kv.bytes_for(rec.window, sinks)
                if ci is not None:
                    ends = [_int_or_none(x) for x in ci]
                    rec.kv_bytes_ci95 = tuple(None if b is None else kv.bytes_for(b, sinks) for b in ends)
            rec.notes.append(kv_note)
            out.append(rec)
    return out


def load_or_fit(path: str | Path, metrics: Sequence[str], cfg: FitConfig | None = None) -> dict:
    """A fit file dict from a fit JSON, or from a results file fitted on the fly (``cfg``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: neither a fit file nor a results file; fitting failed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    with open(path, "rb") as fh:
        head = fh.read(8)
    if head.lstrip()[:1] == b"{":
        return read_fit_file(path)
    cfg = cfg or FitConfig()
    cfg = FitConfig(metrics=tuple(metrics), families=cfg.families, fit_range=cfg.fit_range,
                    holdout_range=cfg.holdout_range, n_boot=cfg.n_boot, seed=cfg.seed, level=cfg.level)
    return fit_results([str(path)], cfg).to_json()


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def format_recommendations(recs: Sequence[Recommendation]) -> str:
    """A readable table of recommendations, then their warnings and notes."""
    rows = [("curve", "metric", "eps", "w(eps) law [95% CI]", "window", "measured (crossing)", "KV bytes/seq [95% CI]")]
    for r in recs:
        ci = ""
        if r.w_law_ci95 is not None:
            ci = f" [{r.w_law_ci95[0]:.4g}, {r.w_law_ci95[1]:.4g}]"
        meas = "-" if r.measured_window is None else str(r.measured_window)
        if r.measured_crossing is not None:
            meas += f" ({r.measured_crossing:.4g})"
        kv = _fmt_bytes(r.kv_bytes)
        if r.kv_bytes_ci95 is not None:
            kv += f" [{_fmt_bytes(r.kv_bytes_ci95[0])}, {_fmt_bytes(r.kv_bytes_ci95[1])}]"
        rows.append((r.label, r.metric, f"{r.eps:g}", f"{r.w_law:.4g}{ci}", str(r.window), meas, kv))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    seen = set()
    for r in recs:
        for w in r.warnings:
            lines.append(f"warning: {r.label} {r.metric} eps={r.eps:g}: {w}")
        for n in r.notes:
            if (r.label, n) not in seen and not n.startswith("eps is outside"):
                seen.add((r.label, n))
                lines.append(f"note: {r.label}: {n}")
            elif n.startswith("eps is outside"):
                lines.append(f"note: {r.label} {r.metric} eps={r.eps:g}: {n}")
    lines.append("w(eps) = (C/eps)^(1/alpha) from the power law (arXiv 2605.25085); interval: percentile bootstrap over documents")
    return "\n".join(lines)
