"""Margins of the decisions a golden output prints, so that no golden sits on a knife's edge.

A printed count (coverage, failures, top-1 agreement) or a kept set is a threshold decision. When a
value sits at its threshold to float precision, another CPU's kernels (AVX-512 against AVX2, another
thread count) flip it and the golden fails for a reason that is not a change of truncsens. The golden
fixture records every such decision while the commands run, and asserts each margin is well above
float noise; the golden commands use targets chosen so.

Decisions and their margins (each the smallest over a run):
- ``draw``: a Poisson draw keeps key i when u_i < π_i; margin |u_i − π_i| / π_i over tail keys
  (0 < π_i < 1). π is float64 from float32 scores (noise about 1e-7 relative).
- ``top``: a top-k selection (the certain set of poisson, topk, h2o, snapkv) is rerun with its scores
  moved by up to :data:`PERTURBATION_ULPS` float32 ulps (two patterns); a selection that changes is
  counted as unstable. Scores within :data:`truncsens.policies.base.TIE_TOLERANCE` of each other are one
  tie group (a previous-token head gives every window key about 1, a few ulps apart), so only a gap
  near that tolerance could be unstable.
- ``argmax``: top-1 of the reference and of the kept distribution (top-1 agreement, failures);
  margin: top-1 minus top-2 log-probability (nats).
- ``nll``: certify's failure rule NLL > ln 4; margin |NLL − ln 4| / ln 4.
- coverage (from a certify results file, :func:`certify_margins`): error ≤ radius for the emitted
  certificate, r_EB and the normal radius at every δ printed, and error ≤ the arithmetic floor;
  margin |error − radius| over 1e-4 relative plus the float64 rounding of the error; the same for the
  tolerance curve r_EB + τ‖ô‖ (every τ the summary prints), and each record's tail attention mass
  against the negligible-mass threshold (1e-4 relative).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

import truncsens.certificates.driver as certify_driver
import truncsens.engine.block.passes as block_passes
import truncsens.engine.kernel as kernel
import truncsens.policies.base as base
import truncsens.policies.poisson as poisson
import truncsens.policies.snapkv as snapkv
import truncsens.policies.topk as topk
from truncsens.certificates.arithmetic import certificate_records
from truncsens.certificates.attribution import FAILURE_NLL
from truncsens.certificates.estimator import F64_RESOLUTION
from truncsens.certificates.statistics import NEGLIGIBLE_TAIL_MASS, RELIABILITY_DELTAS, TOLERANCES, radii_at

# "well above float noise": relative for scores, radii and probabilities; nats for log-probabilities
MIN_MARGIN = {"draw": 1e-4, "argmax": 1e-4, "nll": 1e-4, "coverage": 1e-4}
PERTURBATION_ULPS = 4  # what another machine's kernels may move a float32 score by
FLOAT32_EPS = torch.finfo(torch.float32).eps


class DecisionRecorder:
    """Records the margins of the decisions made while it is :meth:`patched` in (module docstring)."""

    def __init__(self) -> None:
        self.margins = {name: math.inf for name in ("draw", "argmax", "nll")}
        self.unstable = 0  # top-k selections that change when their scores move by float noise

    def _note(self, name: str, value: float) -> None:
        self.margins[name] = min(self.margins[name], value)

    def _draw(self, real):
        def draw(pi, uniforms):
            p = pi.to(torch.float64)
            u = torch.as_tensor(uniforms, dtype=torch.float64).expand_as(p)
            tail = (p > 0) & (p < 1)
            if bool(tail.any()):
                self._note("draw", float(((u - p).abs() / p)[tail].min()))
            return real(pi, uniforms)
        return draw

    def _selection(self, real):
        def select(values, allowed, count, *args, **kwargs):
            chosen = real(values, allowed, count, *args, **kwargs)
            for trial in range(2):  # scores moved by up to PERTURBATION_ULPS float32 ulps, two patterns
                u = torch.rand(values.shape, generator=torch.Generator().manual_seed(trial), dtype=torch.float64)
                moved = values * (1 + PERTURBATION_ULPS * FLOAT32_EPS * (2 * u - 1)).to(values.dtype)
                if not torch.equal(real(moved, allowed, count, *args, **kwargs), chosen):
                    self.unstable += 1
                    break
            return chosen
        return select

    def _metrics(self, real):
        def store(metrics, index, ref_lp, lp, token_id):
            for x in (ref_lp, lp):
                two = torch.log_softmax(x.to(torch.float64), -1).topk(2, dim=-1).values  # [b, 2]
                self._note("argmax", float((two[..., 0] - two[..., 1]).min()))
            nll = -torch.log_softmax(lp.to(torch.float64), -1).gather(-1, token_id.view(-1, 1).to(lp.device))
            self._note("nll", float(((nll - FAILURE_NLL).abs() / FAILURE_NLL).min()))
            return real(metrics, index, ref_lp, lp, token_id)
        return store

    @contextlib.contextmanager
    def patched(self, monkeypatch):
        """Wrap the decision points (their behaviour unchanged) for the duration of the block."""
        monkeypatch.setattr(poisson, "draw", self._draw(poisson.draw))
        top = self._selection(base.top_per_row)
        for module in (base, poisson, snapkv):
            monkeypatch.setattr(module, "top_per_row", top)
        smallest = self._selection(base.smallest_k)
        for module in (poisson, topk):  # random's smallest_k ranks seeded uniforms: no float noise
            monkeypatch.setattr(module, "smallest_k", smallest)
        store = self._metrics(kernel.store_metrics)
        for module in (kernel, certify_driver, block_passes):
            monkeypatch.setattr(module, "store_metrics", store)
        try:
            yield self
        finally:
            monkeypatch.undo()

    def too_small(self) -> dict[str, float]:
        """The recorded margins below :data:`MIN_MARGIN` and the count of unstable selections under
        ``"top"`` (empty when every decision is safe)."""
        small = {k: v for k, v in self.margins.items() if v <= MIN_MARGIN[k]}
        return {**small, "top": self.unstable} if self.unstable else small


def certify_margins(ds) -> dict[str, float]:
    """Smallest margin of each coverage decision a certify summary prints (module docstring), over
    every budget and record with a random tail: ``{name: margin}`` with names ``floor``,
    ``certificate@δ``, ``eb@δ``, ``normal@δ`` for the file's δ and :data:`RELIABILITY_DELTAS`, and
    ``resolution`` (a nonzero error's distance from the float64 resolution below which errors are
    stored as 0, :func:`truncsens.certificates.estimator.resolved_error`).

    A margin is |error − radius| over its noise, 1e-4 · max(error, radius) + 16 float64 ulps of
    max(‖o‖, ‖ô‖) (the error is a float64 norm of a difference of two outputs), minus 1: positive when
    the decision is safe. An error stored as 0 (below float64 resolution) is covered by every radius on
    every machine: it decides nothing."""
    out: dict[str, float] = {}
    eps64 = float(np.finfo(np.float64).eps)

    def note(name, error, radius, scale):
        e, r = np.asarray(error, float), np.asarray(radius, float)
        decided = np.isfinite(e) & np.isfinite(r) & (e != 0)
        e, r, s = e[decided], r[decided], scale[decided]
        margin = np.abs(e - r) / (MIN_MARGIN["coverage"] * np.maximum(e, r) + 16 * eps64 * s) - 1
        out[name] = min(out.get(name, math.inf), float(margin.min()) if margin.size else math.inf)

    for k in ds["budget"].values:
        r = certificate_records(ds, "poisson", int(k))
        tail = r["has_tail"] > 0
        scale = np.broadcast_to(np.maximum(ds["attn_norm"].sel(policy="poisson", budget=k).values,
                                           ds["attn_hat_norm"].sel(policy="poisson", budget=k).values), tail.shape)[tail]
        e, floor = r["attn_error"][tail], np.broadcast_to(r["arith_bound"], tail.shape)[tail]
        note("floor", e, floor, scale)
        note("resolution", e, 2 * F64_RESOLUTION * scale, scale)
        o_hat = np.broadcast_to(ds["attn_hat_norm"].sel(policy="poisson", budget=k).values, tail.shape)[tail]
        eb_file = r["radius_eb"][tail]
        for tau in TOLERANCES:  # the tolerance curve: r_EB + tau ||o^|| at the file's delta
            note(f"tolerance@{tau}", e, eb_file + tau * o_hat, scale)
        if "attn_tail_mass" in ds:  # r_EB's coverage apart where the tail holds (almost) no attention
            mass = np.broadcast_to(ds["attn_tail_mass"].sel(policy="poisson", budget=k).values, tail.shape)[tail]
            rel = np.abs(mass - NEGLIGIBLE_TAIL_MASS) / NEGLIGIBLE_TAIL_MASS
            out["tail_mass"] = min(out.get("tail_mass", math.inf), float(rel.min() / MIN_MARGIN["coverage"] - 1))
        for d in sorted({*RELIABILITY_DELTAS, float(ds.attrs["delta"])}):
            eb, normal = radii_at(r["attn_variance"], r["value_range"], r["n_random"], r["has_tail"], d)
            note(f"eb@{d}", e, eb[tail], scale)
            note(f"normal@{d}", e, normal[tail], scale)
            note(f"certificate@{d}", e, eb[tail] + floor, scale)
    return out
