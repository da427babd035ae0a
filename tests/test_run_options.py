"""Run options are declared once (truncsens.engine.options, truncsens.certificates.options): the API
functions take exactly those keywords (plus the few of their own listed here), the commands exactly
those options (plus their own), with the declared defaults; resume, join and provenance read the same
declarations; and ``--help`` names values (N, LIST, PATH) instead of Typer's type column."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

from truncsens.api.certify import certify, certify_config
from truncsens.api.certify_attribution import attribution_config, certify_attribution
from truncsens.api.measure import measure, measure_config
from truncsens.certificates.options import AttributionOptions, CertifyCommandOptions
from truncsens.cli.main import app
from truncsens.cli.options import run_command
from truncsens.engine.config import LATER_OPTIONS, RUN_ONLY_FIELDS
from truncsens.engine.options import MeasureOptions, config_fields, later_options, option, recorded_attrs, run_options
from truncsens.results.join import ATTR_DEFAULTS

# keywords an API function has beyond the declared run options: the model object's tokenizer, texts
# instead of a corpus, where to draw the figures
OWN_KEYWORDS = {
    measure_config: {"texts"}, measure: {"tokenizer", "texts"},
    certify_config: set(), certify: {"tokenizer", "plot_out"},
    attribution_config: set(), certify_attribution: {"tokenizer", "plot_out"},
}
DECLARED = {measure_config: MeasureOptions, measure: MeasureOptions, certify_config: CertifyCommandOptions,
            certify: CertifyCommandOptions, attribution_config: AttributionOptions,
            certify_attribution: AttributionOptions}
# the functions that take a model object: device / dtype None is "the object's own" (a spec: the declared
# default), command None "this call"
NONE_DEFAULTS = {measure: {"dtype", "command"}, certify: {"device", "dtype", "command"},
                 certify_attribution: {"device", "dtype", "command"}}
# options a command has beyond its run options
OWN_OPTIONS = {"measure": set(), "certify": {"as_json"}, "certify-attribution": {"as_json"}}
COMMAND_OPTIONS = {"measure": MeasureOptions, "certify": CertifyCommandOptions, "certify-attribution": AttributionOptions}


def _command(name: str):
    return typer.main.get_command(app).commands[name]


@pytest.mark.parametrize("function", list(OWN_KEYWORDS), ids=lambda f: f.__name__)
def test_api_keywords_are_the_declared_options(function):
    params = inspect.signature(function).parameters
    declared = {o.keyword: o for o in run_options(DECLARED[function])}
    assert set(params) - OWN_KEYWORDS[function] == set(declared)
    for keyword, o in declared.items():
        expected = None if keyword in NONE_DEFAULTS.get(function, ()) else o.default
        assert params[keyword].default == expected, keyword


@pytest.mark.parametrize("name", list(COMMAND_OPTIONS))
def test_command_options_are_the_declared_options(name):
    params = {p.name: p for p in _command(name).params}
    declared = {o.keyword: o for o in run_options(COMMAND_OPTIONS[name]) if o.cli}
    assert set(params) - OWN_OPTIONS[name] == set(declared)
    for keyword, o in declared.items():
        # a list held as one comma-separated text (certify --budgets) is Typer's one repeat of it
        assert params[keyword].default == ([o.default] if o.kind == "text_list" and o.default is not None else o.default), keyword
        assert "/".join(params[keyword].opts + params[keyword].secondary_opts) == o.flag, keyword


def test_the_renamed_and_switch_options_keep_their_flags():
    """The flags users type, pinned: a declaration's keyword renames the flag with it."""
    flags = {o.field: o.flag for o in run_options(MeasureOptions)}
    assert (flags["n_sink"], flags["max_batch_tokens"], flags["policies"], flags["policy_args"]) == (
        "--sinks", "--batch-tokens", "--policy", "--policy-arg")
    assert (flags["progress"], flags["resume"], flags["per_layer"]) == ("--progress/--no-progress", "--resume", "--per-layer")


def test_resume_and_join_read_the_declarations():
    assert set(RUN_ONLY_FIELDS) == {"out", "resume", "overwrite", "progress", "command", "device", "max_batch_tokens"}
    assert LATER_OPTIONS == {"bos": "auto", "chunk": 1, "policy_args": None, "observation_window": None,
                             "pooling_kernel": None, "n_summary": None, "protocol": "exact", "granularity": "token", "draws": 1,
                             "per_layer": False}
    # the join's defaults of attrs a file may lack live below the engine: they must agree with the declarations
    assert {k: LATER_OPTIONS[k] for k in ATTR_DEFAULTS} == ATTR_DEFAULTS


@dataclass
class _Options:
    count: int = option(3, "A count.")
    sizes: list[int] | None = option(None, "Sizes.", flag="--size")
    loud: bool = option(True, "Loud.", attr=True)
    n_things: int | None = option(None, "Things.", keyword="things", attr=True)
    internal: float = 0.5


def test_keywords_map_onto_fields_and_attrs_are_recorded():
    assert config_fields(_Options, {"things": 2, "count": 1}) == {"n_things": 2, "count": 1}
    with pytest.raises(TypeError, match="unknown option.*n_things"):
        config_fields(_Options, {"n_things": 2})
    assert recorded_attrs(_Options(n_things=7)) == {"loud": True, "n_things": 7}
    assert [o.keyword for o in run_options(_Options)] == ["count", "sizes", "loud", "things"]


def test_run_command_parses_the_declared_options():
    """A command of declared options gets them parsed as the API takes them, beside its own."""
    got = {}
    demo = typer.Typer()

    @run_command(_Options)
    def show(extra: str = typer.Option("x", help="Its own."), **options):
        got.update(options, extra=extra)

    demo.command()(show)
    demo.command("other")(lambda: None)  # two commands: the options come after the command name
    r = CliRunner().invoke(demo, ["show", "--size", "1,2", "--size", "4", "--no-loud", "--things", "5", "--extra", "y"])
    assert r.exit_code == 0, r.output
    assert got == {"count": 3, "sizes": [1, 2, 4], "loud": False, "things": 5, "extra": "y"}
    r = CliRunner().invoke(demo, ["show", "--size", "1,a"])
    assert r.exit_code == 2 and "--size must be comma-separated whole numbers, got '1,a'" in r.output


TYPE_COLUMNS = ("<list[", "<bool>", "<int>", "<str>", "<float>", "<path>")


@pytest.mark.parametrize("args", [[], *[[name] for name in typer.main.get_command(app).commands]],
                         ids=lambda a: " ".join(a) or "truncsens")
def test_help_names_values_instead_of_types(args):
    r = CliRunner().invoke(app, [*args, "--help"], terminal_width=200)
    assert r.exit_code == 0
    assert not [t for t in TYPE_COLUMNS if t in r.output], r.output
    if args == ["measure"]:  # the declared metavars, and typer's fallback by type
        assert "--windows" in r.output and " LIST " in r.output and " PATH " in r.output and " N " in r.output


def test_certify_draws_and_variance_are_later_options_of_certify_only():
    """certify's --draws and --variance came after certify results existed: at their defaults they stay
    out of the resume fingerprint (an earlier run resumes), changed they enter it; attribution has neither."""
    from truncsens.certificates.config import CertifyConfig

    later = later_options(CertifyCommandOptions)
    assert later["draws"] == 1 and later["variance"] == "hajek"
    assert not {"draws", "variance"} & {o.keyword for o in run_options(AttributionOptions)}
    base = CertifyConfig(out="x.nc").fingerprint()
    assert "draws" not in base and "variance" not in base
    changed = CertifyConfig(out="x.nc", draws=4, variance="hajek_bias").fingerprint()
    assert changed["draws"] == 4 and changed["variance"] == "hajek_bias"
    assert {k: v for k, v in changed.items() if k not in ("draws", "variance")} == base
