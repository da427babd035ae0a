"""How the measurements of ``truncsens plan`` (:mod:`truncsens.api.plan`) run: the per-layer window
configurations measured on a set of targets (:func:`truncsens.engine.layer_windows_pass.measure_layer_windows`),
and the forward tokens that costs, which the plan's progress counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass
class PlanPasses:
    """How every per-layer measurement of a plan runs: the model, the sinks, the token budget of a
    pass, the semantics and the metric planned for; ``on_tokens(n)``: n forward tokens done (progress)."""

    loaded: Any
    sinks: int
    batch: int
    semantics: str
    metric: str
    on_tokens: Callable[[int], None] | None = None

    @property
    def n_layers(self) -> int:
        """L, the model's layers."""
        from truncsens.engine.attention_windows import layer_windows

        return len(layer_windows(self.loaded.model).windows)

    def tokens(self, targets, n_configs: int) -> int:
        """Forward tokens of :meth:`measure` on ``targets`` (contexts [n, N]) under ``n_configs``
        configurations: each target's prefill (N tokens) and each configuration's pass (the semantics'
        cost at budget 0: one decode token under prefill_evict, N under streaming)."""
        from truncsens.engine.semantics import semantics_for

        n, N = targets.context.shape
        return n * (N + n_configs * semantics_for(self.semantics).cost(N, 0))

    def measure(self, targets, configs: list) -> np.ndarray:
        """The metric of every target under every window configuration (one window or None per layer): [configs, n]."""
        import torch

        from truncsens.engine.layer_windows_pass import measure_layer_windows

        with torch.no_grad():
            values, _ = measure_layer_windows(self.loaded.model, targets, configs, self.sinks, self.loaded.device,
                                              self.batch, self.on_tokens, semantics=self.semantics)
        return values[self.metric].astype(np.float64)
