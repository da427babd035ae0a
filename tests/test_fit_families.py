"""Contracts every fit family record (truncsens.fits.laws.FAMILY_RECORDS) meets; a new record is checked by
these tests without naming it: its point fit, its batch fit and its law agree, it draws and it is named
in ``truncsens fit --help``."""
from __future__ import annotations

import math

import numpy as np
import pytest
from typer.testing import CliRunner

from truncsens.cli.main import app
from truncsens.fits.laws import FAMILIES, FAMILY_RECORDS, family_record, fit_family, fit_family_batch, law_log

RECORDS = {f.name: f for f in FAMILY_RECORDS}
X = np.array([4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128.0])  # [S] windows in tokens
# a decaying curve with a floor and a fixed wiggle, so that no family fits it exactly: D = 2 w^-0.7 + 1e-3
Y = np.log(2 * X ** -0.7 + 1e-3) + 0.02 * np.sin(X)  # [S] log means
W = np.linspace(1.0, 3.0, X.size)  # [S] WLS weights


def test_names_are_unique_and_lookups_use_the_records():
    assert FAMILIES == tuple(RECORDS) and len(set(FAMILIES)) == len(FAMILIES)
    for name, record in RECORDS.items():
        assert family_record(name) is record
    with pytest.raises(ValueError, match="unknown law family 'cubic'; choose from " + ", ".join(FAMILIES)):
        family_record("cubic")


@pytest.mark.parametrize("name", FAMILIES)
def test_point_fit_reports_its_parameters_and_its_residuals(name):
    record = RECORDS[name]
    fit = fit_family(name, X, Y, W)
    assert fit["converged"] and set(record.params) <= set(fit)
    assert 1 <= record.n_params <= len(record.params)
    wrss = float((W * (Y - law_log(name, {k: fit[k] for k in record.params}, X)) ** 2).sum())  # the definition
    assert fit["wrss"] == pytest.approx(wrss, rel=1e-12)
    n = X.size  # llf of a Gaussian WLS fit, written out
    llf = -n / 2 * (math.log(2 * math.pi * wrss / n) + 1) + 0.5 * float(np.log(W).sum())
    assert fit["aic"] == pytest.approx(-2 * llf + 2 * record.n_params, rel=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_fit_of_the_same_curve_is_the_point_fit(name):
    point = fit_family(name, X, Y, W)
    batch = fit_family_batch(name, X, np.tile(Y, (2, 1)), np.tile(W, (2, 1)), start=point)  # [2, S]: the curve twice
    for p in RECORDS[name].params:
        assert batch[p].shape == (2,)
        np.testing.assert_allclose(batch[p], point[p], rtol=1e-6)


@pytest.mark.parametrize("name", FAMILIES)
def test_too_few_windows_for_the_parameters_is_refused(name):
    from truncsens.fits.laws import FitError

    need = RECORDS[name].n_params + 1
    w = np.where(np.arange(X.size) < need - 1, 1.0, 0.0)  # one window short
    with pytest.raises(FitError, match=f"{name} needs at least {need} windows"):
        fit_family(name, X, Y, w)


def test_every_family_has_its_own_line_style_and_legend():
    assert len({f.style for f in FAMILY_RECORDS}) == len(FAMILY_RECORDS)
    assert all(f.label and f.help for f in FAMILY_RECORDS)


def test_fit_help_names_every_family():
    out = CliRunner().invoke(app, ["fit", "--help"], env={"COLUMNS": "300"}).output
    text = " ".join(out.split())
    for record in FAMILY_RECORDS:
        assert record.help in text and record.name in text


def test_lm_steps_never_hand_lapack_a_non_finite_system(capfd):
    """The batched power_floor refit of bootstrap resamples: a resample whose normal equations hold inf or
    NaN (its Jacobian or damping overflowed) beside a singular one used to send the whole batch to
    least squares, where LAPACK printed "On entry to DLASCL parameter number 4 had an illegal value" and
    the fit stopped with "SVD did not converge in Linear Least Squares" (the README's policy comparison,
    `random`'s KL). The non-finite resample stays where it is (step 0); the others are solved."""
    from truncsens.fits.least_squares import _damped_steps

    regular = np.diag([2.0, 4.0, 8.0])
    damped = np.stack([regular, np.zeros((3, 3)), np.full((3, 3), np.inf), np.diag([1.0, np.nan, 1.0])])
    g = np.array([[2.0, 4.0, 8.0], [1.0, 1.0, 1.0], [1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    steps = _damped_steps(damped, g)
    assert np.allclose(steps[0], [1.0, 1.0, 1.0])  # solved (by least squares: the batch holds a singular system)
    assert np.array_equal(steps[1], [0.0, 0.0, 0.0])  # singular, all zero: the least-norm step
    assert np.array_equal(steps[2], [0.0, 0.0, 0.0]) and np.array_equal(steps[3], [0.0, 0.0, 0.0])
    assert np.array_equal(_damped_steps(damped[[0, 2]], g[[0, 2]]), [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    out, err = capfd.readouterr()
    assert "DLASCL" not in out + err and out == "" and err == ""

