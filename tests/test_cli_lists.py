"""Every list option of every command takes repeats and commas in any mix (one parser,
:mod:`truncsens.cli.options`): checked on the click options of the app, then command by command on the
values the API receives (the API function is replaced by one that records its keywords)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from truncsens.cli.main import app

runner = CliRunner()


class Called(Exception):
    """Raised by a stand-in API function: the command got as far as calling it."""


def record(monkeypatch, module: str, name: str) -> dict:
    """Replace ``module.name`` by a function that keeps its keywords and stops the command."""
    import importlib

    seen: dict = {}

    def stand_in(*args, **kwargs):
        seen.update(kwargs, _args=args)
        raise Called()

    monkeypatch.setattr(importlib.import_module(module), name, stand_in)
    return seen


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert isinstance(r.exception, Called), (r.exit_code, r.output, r.exception)
    return r


def list_options():
    """(command, option) for every option that says it takes a list: metavar LIST, or help saying comma-separated."""
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for p in command.params:
            if p.param_type_name != "option":
                continue
            text = (p.help or "").lower()
            if p.metavar == "LIST" or "comma-separated" in text:
                yield name, p


@pytest.mark.parametrize("name,param", list(list_options()), ids=lambda v: v if isinstance(v, str) else v.opts[0])
def test_every_list_option_is_repeatable(name, param):
    """A list option that Typer parses as one value keeps only the last repeat (certify --budgets 128
    --budgets 256 measured 256 alone)."""
    assert param.multiple, f"{name} {param.opts[0]} takes a list but keeps only its last repeat"
    assert "comma-separated" in (param.help or "") and "repeated" in (param.help or ""), (name, param.opts[0], param.help)


def test_the_list_options_are_found():
    found = {(n, p.opts[0]) for n, p in list_options()}
    assert {("certify", "--budgets"), ("certify", "--policies"), ("certify-attribution", "--budgets"),
            ("certify-attribution", "--policies"), ("plan", "--sweep"), ("measure", "--windows"),
            ("measure", "--policy"), ("measure", "--budgets"), ("plan", "--average-window")} <= found


def test_certify_budgets_and_policies(monkeypatch):
    seen = record(monkeypatch, "truncsens.api.certify", "certify_config")
    invoke("certify", "--budgets", "128", "--budgets", "256,12.5%", "--policies", "poisson", "--policies", "topk,random")
    assert seen["budgets"] == "128,256,12.5%" and seen["policies"] == "poisson,topk,random"
    invoke("certify")
    assert seen["budgets"] == "12.5%,25%,50%" and seen["policies"] is None  # the defaults, as before


def test_certify_attribution_budgets_and_policies(monkeypatch):
    seen = record(monkeypatch, "truncsens.api.certify_attribution", "attribution_config")
    invoke("certify-attribution", "--budgets", "25%", "--budgets", "50%", "--policies", "poisson,topk", "--policies", "random")
    assert seen["budgets"] == "25%,50%" and seen["policies"] == "poisson,topk,random"


def test_measure_windows_policies_budgets(monkeypatch):
    seen = record(monkeypatch, "truncsens.api.measure", "measure_config")
    invoke("measure", "--windows", "1,2", "--windows", "4")
    assert seen["windows"] == [1, 2, 4]
    invoke("measure", "--policy", "sink_recent", "--policy", "random,h2o", "--budgets", "16", "--budgets", "32,64")
    assert seen["policies"] == ["sink_recent", "random", "h2o"] and seen["budgets"] == [16, 32, 64]


def test_plan_sweep_windows_bytes_and_eps(monkeypatch):
    seen = record(monkeypatch, "truncsens.api.plan", "plan")
    invoke("plan", "--sweep", "4,8", "--sweep", "16", "--average-window", "64", "--average-window", "128,256")
    assert seen["sweep"] == [4, 8, 16] and seen["average_windows"] == [64.0, 128.0, 256.0]
    invoke("plan", "--kv-bytes", "1000", "--kv-bytes", "2000,3000", "--eps", "0.1", "--eps", "0.2,0.3")
    assert seen["kv_bytes"] == [1000, 2000, 3000] and seen["eps"] == [0.1, 0.2, 0.3] and seen["sweep"] is None


def test_metric_lists_of_show_plot_compare_fit_recommend(monkeypatch, tmp_path):
    cases = [("show", "truncsens.api.show", "show", ["show", tmp_path / "a.nc"]),
             ("plot", "truncsens.api.plot", "plot", ["plot", tmp_path / "a.nc", "--out", tmp_path / "f"]),
             ("compare-policies", "truncsens.api.compare", "compare_policies", ["compare-policies", tmp_path / "a.nc"]),
             ("fit", "truncsens.api.fit", "fit", ["fit", tmp_path / "a.nc"]),
             ("recommend-window", "truncsens.api.recommend", "recommend_window", ["recommend-window", tmp_path / "a.nc", "--eps", "0.1"])]
    import importlib

    for _, module, _, _ in cases:  # imported unpatched: a module importing another's function binds it once
        importlib.import_module(module)
    for command, module, name, args in cases:
        with monkeypatch.context() as patch:
            seen = record(patch, module, name)
            invoke(*args, "--metric", "tv", "-m", "kl,js")
        assert seen["metrics"] == ["tv", "kl", "js"], command
