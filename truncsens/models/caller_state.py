"""What a run changes on a caller's model object, put back on the way out (errors included).

A model object passed to the Python API (``truncsens.measure(model, tokenizer, ...)`` and the other
commands' functions) is run where it is: :func:`~truncsens.models.sources.in_memory_model` puts it in
eval mode (dropout off), the block protocol may switch its attention implementation on CUDA
(``flash_attention_2`` or ``sdpa``), and passes hook its attention modules. The caller gets back the
model as it was: :func:`caller_state` records each module's ``training`` flag, the config's attention
implementation and the forward hooks present, and restores them when the call ends.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks_with_kwargs")


@contextlib.contextmanager
def caller_state(model: Any) -> Iterator[None]:
    """Inside the block a run may change ``model``; on the way out (errors included) every module's
    ``training`` flag, the attention implementation (``config._attn_implementation``, set back with
    ``set_attn_implementation``) and the forward hooks are those it had on the way in (hooks added
    inside and not removed are removed). Anything but a ``torch.nn.Module`` (a model spec, a
    :class:`~truncsens.models.loaded.LoadedModel`) passes through unchanged."""
    import torch

    if not isinstance(model, torch.nn.Module):
        yield
        return
    modules = list(model.modules())
    training = [m.training for m in modules]
    hooks = [{name: set(getattr(m, name, {}) or {}) for name in HOOK_DICTS} for m in modules]
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    try:
        yield
    finally:
        for module, flag, held in zip(modules, training, hooks):
            module.training = flag
            for name, keys in held.items():
                table = getattr(module, name, None)
                for key in [k for k in (table or {}) if k not in keys]:
                    del table[key]
        if attention is not None and getattr(config, "_attn_implementation", None) != attention \
                and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(attention)


def keeps_caller_state(function: F) -> F:
    """``function`` (an API function whose first argument is ``model``) run inside :func:`caller_state`
    of that argument."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        with caller_state(model):
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]
