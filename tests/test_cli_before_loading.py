"""Argument errors that need no model (an unknown --domain, a missing corpus folder, a negative budget,
a window or budget at or above N) are one error line before the model loads, not after it (58 s for
the reference model under load, minutes for a real one): the model loader is replaced by one that
fails the test if it is reached."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from truncsens.cli.main import app


class Loaded(Exception):
    """The command reached the model loader."""


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    import truncsens.certificates.attribution_driver as attribution
    import truncsens.certificates.driver as certify
    import truncsens.engine.measure as measure
    import truncsens.models as models

    def load_model(*args, **kwargs):
        raise Loaded("the model was loaded")

    for module in (attribution, certify, measure, models):
        monkeypatch.setattr(module, "load_model", load_model)


BUDGETS = {"measure": ["--policy", "sink_recent", "--budgets"], "certify": ["--budgets"],
           "certify-attribution": ["--budgets"], "plan": ["--average-window"]}
WHOLE = {"measure": ["--windows", "64"], "certify": ["--budgets", "64"], "certify-attribution": ["--budgets", "64"],
         "plan": ["--sweep", "64", "--average-window", "8"]}
CASES = [(cmd, "domain", ["--domain", "bogus"], "unknown domain 'bogus'") for cmd in BUDGETS]
CASES += [(cmd, "corpus", ["--corpus", "/no/such/folder"], "corpus path /no/such/folder does not exist") for cmd in BUDGETS]
CASES += [(cmd, "negative", [*BUDGETS[cmd], "-4"], "at least 1") for cmd in BUDGETS]
CASES += [(cmd, "at-N", [*WHOLE[cmd], "--reference-context", "64"], "64") for cmd in BUDGETS]
CASES += [("measure", "merge-head", ["--policy", "merge_nearest", "--semantics", "prefill_evict", "--budgets", "16",
                                      "--granularity", "head"], "use --positions original and --granularity token")]


@pytest.mark.parametrize("command,what,args,says", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_argument_errors_come_before_the_model_loads(command, what, args, says, tmp_path):
    out = [] if command == "plan" else ["--out", tmp_path / "r.nc"]
    r = CliRunner().invoke(app, [command, *map(str, args), *map(str, out)])
    assert not isinstance(r.exception, Loaded), f"{command} {what}: the model loaded before the error"
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert not (tmp_path / "r.nc").exists()


def test_a_valid_run_still_reaches_the_model(tmp_path):
    r = CliRunner().invoke(app, ["measure", "--windows", "8", "--reference-context", "64", "--out", str(tmp_path / "r.nc")])
    assert isinstance(r.exception, Loaded)
