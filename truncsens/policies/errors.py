"""The error of the policy modules, in a module of its own: the lowest policy modules
(:mod:`truncsens.policies.steps`, :mod:`truncsens.policies.kept`) raise it without importing
:mod:`truncsens.policies.base`, which imports them (re-exported there and from :mod:`truncsens.policies`).
"""

from __future__ import annotations


class PolicyError(ValueError):
    """A policy cannot run as asked; the message names the problem and the fix."""
