"""Answers a user can act on: one --device default for every command that runs a model, ..."""

from __future__ import annotations

import importlib
import inspect

import pytest

import truncsens

MODEL_COMMANDS = ("measure", "plan", "certify", "certify_attribution")


def _default(function, name: str = "device"):
    default = inspect.signature(function).parameters[name].default
    return getattr(default, "default", default)  # typer.Option(...) holds its default


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_command_that_runs_a_model_defaults_to_device_auto(command):
    from truncsens.certificates.config import CertifyConfig
    from truncsens.engine.config import MeasureConfig

    cli = getattr(importlib.import_module(f"truncsens.cli.{command}"), command)
    assert _default(cli) == "auto"
    api = _default(getattr(truncsens, command))
    assert api in ("auto", None)  # None: the default below
    for cls in (MeasureConfig, CertifyConfig):
        assert cls.__dataclass_fields__["device"].default == "auto"
