"""The error of a measurement that cannot run as configured, in a module of its own: the block
modules (:mod:`truncsens.engine.block.plan`, ``passes``, ``policies``) raise it without importing
:mod:`truncsens.engine.config`, which imports the block protocol's checks (re-exported there, the
name callers use).
"""

from __future__ import annotations


class MeasureError(ValueError):
    """A measurement cannot run as configured; the message names the problem and the fix."""
