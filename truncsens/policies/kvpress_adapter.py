"""``kvpress:<PressClass>``: a score-based press of NVIDIA kvpress as a retention policy (``prefill_evict`` only).

Source: NVIDIA kvpress (https://github.com/NVIDIA/kvpress, >= 0.5; the optional extra
``truncsens[kvpress]``). A ``ScorerPress`` scores the keys of each attention layer after the prefill,
``score(module, hidden_states, keys, values, attentions, kwargs) -> [B, H_kv, T']``, and keeps, per
layer and key/value head, the ``n_kept = int(T' (1 - compression_ratio))`` keys of highest score
(``scores.topk(n_kept)``); the question is then decoded against the compressed cache at its
original position (kvpress's pipeline; with ``KeyRerotationPress`` at position n_kept).

Under truncsens's ``prefill_evict`` the prefill is the reference pass over the first T' = T - 1
tokens, and the budget k counts the query's own key (docs/method.md), so the press keeps
``n_kept = k - 1`` keys: :func:`compression_ratio` gives the ratio for which kvpress's
``int(T' (1 - r))`` is exactly k - 1. The press is built per budget (some scores depend on the ratio:
``StreamingLLMPress`` zeroes the ``T' - n_kept`` keys after its sinks) and scores every layer with
the inputs the layer saw in the prefill (:mod:`truncsens.engine.prefill_layers`; ``attentions`` is
None, as under kvpress with SDPA attention) and each layer's prefill keys and values, both handed in
by the engine (a policy never imports the engine: ``prefill_evict``'s
:meth:`~truncsens.engine.semantics.PrefillEvict.scores` gives the layers and the keys and values read
from its prefill cache). The per-head kept sets (:class:`~truncsens.policies.kept.HeadKept`) are
applied exactly, by decoding against a cache gathered per layer and head
(:func:`truncsens.engine.rerotation.decode_gathered`);
``--positions reindexed`` re-rotates them as ``KeyRerotationPress`` does, so that press is not
wrapped itself (use its inner press with ``--positions reindexed``).

The token-level view the results record (``kept_tokens``, ``evicted_attention_mass``) is [ours]:
the k - 1 prefix keys kept by the most (layer, head) pairs (ties: the later key) and the query;
it is exact when every head keeps the same keys (``StreamingLLMPress``), an approximation otherwise.

Importing kvpress patches transformers' attention functions (its head-wise masking for AdaKV-style
presses); the patch acts only on modules that carry ``masked_key_indices``, which this adapter never sets.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from truncsens.policies.base import Policy, PolicyError
from truncsens.policies.kept import head_kept

PREFIX = "kvpress:"
PREFILL_LAYERS = "prefill_layers"  # capability: each attention layer's prefill inputs, keys and values
INSTALL_HINT = "pip install 'truncsens[kvpress]'"
NOT_WRAPPED = {"KeyRerotationPress": "truncsens re-rotates kept keys itself: use the inner press with --positions reindexed"}


def compression_ratio(budget: int, context_len: int) -> float:
    """kvpress's ``compression_ratio`` that keeps ``budget - 1`` of the ``context_len - 1`` prefix keys.

    kvpress keeps ``max(1, int(T' (1 - r)))`` of T' keys; with ``r = 1 - (k - 1/2) / T'`` that is
    ``int(k - 1/2) = k - 1`` whatever the float rounding (0 when nothing is evicted, k = T).

    Args:
        budget: k >= 2 kept keys, the query's own included; context_len: T >= k.
    """
    prefix = context_len - 1
    return 0.0 if budget >= context_len else 1.0 - (budget - 0.5) / prefix


def press_class(press: str):
    """The kvpress class named ``press``, checked to be a score-based press.

    Raises:
        PolicyError: kvpress not importable, no such press, or not a ``ScorerPress`` (each with the fix).
    """
    try:
        module = importlib.import_module("kvpress")
    except ImportError as exc:
        raise PolicyError(f"policy {PREFIX}{press} needs NVIDIA kvpress, which is not importable ({exc}); "
                          f"{INSTALL_HINT}") from None
    if press in NOT_WRAPPED:
        raise PolicyError(f"policy {PREFIX}{press}: {NOT_WRAPPED[press]}")
    cls = getattr(module, press, None)
    if not isinstance(cls, type):
        raise PolicyError(f"kvpress has no press {press!r} (policy {PREFIX}{press}); "
                          f"installed kvpress {getattr(module, '__version__', '?')}, {INSTALL_HINT} for another version")
    if not issubclass(cls, module.ScorerPress):
        raise PolicyError(f"kvpress press {press} is not a ScorerPress; the adapter runs score-based presses "
                          "(KnormPress, StreamingLLMPress, SnapKVPress, ...)")
    return cls


def parse_value(text: str) -> int | float | bool | str:
    """``"8"`` -> 8, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool, anything else the string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_policy_args(items: Sequence[str] | None) -> dict | None:
    """``["n_sink=8", "window_size=16"]`` -> ``{"n_sink": 8, "window_size": 16}`` (None for none).

    Raises:
        PolicyError: an item without ``=``, an empty key, or a key given twice.
    """
    if not items:
        return None
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise PolicyError(f"policy_args (--policy-arg) takes key=value, got {item!r}")
        if key in out:
            raise PolicyError(f"policy_args (--policy-arg) {key} given twice")
        out[key] = parse_value(value.strip())
    return out


@dataclass
class KVPressPolicy(Policy):
    """A kvpress ``ScorerPress`` (class attribute ``press``) keeping k - 1 prefix keys per layer and head.

    Attributes:
        policy_args: the press's own parameters (``--policy-arg``; ``compression_ratio`` follows from
            the budget and is not one of them). Parameters the press does not have are dropped (one
            set of ``--policy-arg`` configures several presses, as ``make_policy`` does for the
            other options; :func:`check_policy_args` refuses those no press takes).

    Raises:
        PolicyError: kvpress missing, unknown press, ``compression_ratio`` given, or values the press refuses.
    """

    name: ClassVar[str] = PREFIX
    press: ClassVar[str] = ""
    layer_heads: ClassVar[bool] = True
    policy_args: dict | None = None

    def __post_init__(self) -> None:
        args = dict(self.policy_args or {})
        if "compression_ratio" in args:
            raise PolicyError(f"policy {self.name}: compression_ratio follows from --budgets (k - 1 of the T - 1 "
                              "prefix keys are kept); do not pass it")
        known = type(self).parameters()
        self.policy_args = {k: v for k, v in args.items() if k in known} or None
        self.build(0.0)  # the press's own checks of its arguments, once

    @classmethod
    def parameters(cls) -> set[str]:
        """The press's parameters that ``--policy-arg`` may set (its dataclass fields but ``compression_ratio``)."""
        return {f.name for f in dataclasses.fields(press_class(cls.press))} - {"compression_ratio"}

    def build(self, ratio: float):
        """The press with ``compression_ratio=ratio`` and :attr:`policy_args`.

        Raises:
            PolicyError: the press refuses its arguments.
        """
        try:
            return press_class(self.press)(compression_ratio=ratio, **(self.policy_args or {}))
        except (TypeError, ValueError, AssertionError) as exc:
            raise PolicyError(f"press {self.press} refused {self.policy_args or {}}: {exc}") from None

    def score_kind(self) -> str:
        """``"prefill_layers"`` (scores come from the press, see :meth:`keep`)."""
        return PREFILL_LAYERS

    def requirements(self) -> frozenset[str]:
        """Each layer's prefill inputs and cache (:data:`PREFILL_LAYERS`: only ``prefill_evict``)."""
        return frozenset({PREFILL_LAYERS})

    def min_budget(self) -> int:
        """2: kvpress keeps at least one prefix key."""
        return 2

    @torch.no_grad()
    def head_index(self, budget: int, layers, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[L, B, H_kv, k - 1] int64 kept prefix positions per layer and head, increasing.

        Args:
            budget: k; layers: :class:`~truncsens.engine.prefill_layers.PrefillLayers` (read through its
                ``model``, ``modules``, ``hidden_states`` and ``kwargs``); kv: L pairs (keys, values)
                [B, H_kv, T - 1, d] of the prefill cache, layer by layer.

        Raises:
            PolicyError: the press refuses to score (e.g. ``StreamingLLMPress`` with more sinks than keys).
        """
        T1 = kv[0][0].shape[2]  # T - 1
        press = self.build(compression_ratio(budget, T1 + 1))
        press.post_init_from_model(layers.model)
        out = []
        for layer in range(len(layers.modules)):
            scores = score_layer(press, layers, kv, layer, f"at budget {budget}")  # [B, H, T-1]
            top = scores.topk(budget - 1, dim=-1).indices  # [B, H, k-1], kvpress's selection
            out.append(torch.sort(top, dim=-1).values)
        return torch.stack(out)  # [L, B, H, k-1]

    def keep(self, context_len: int, budget: int, queries: torch.Tensor, seeds: Sequence[int], scores=None):
        """Per-head kept sets of the target's query.

        Args:
            context_len: T; budget: k (2 <= k <= T); queries: [1] = [T - 1] (``prefill_evict``);
            seeds: one per sequence (unused); scores: ``(layers, kv)`` of the reference pass, the
                arguments of :meth:`head_index`.

        Returns:
            :class:`~truncsens.policies.kept.HeadKept` (``heads`` [L, B, H_kv, k - 1]; ``keep``
            [B, 1, T] the token-level view of the module docstring).

        Raises:
            PolicyError: budget out of range, queries other than the last position, or no prefill layers.
        """
        self.check(budget, context_len)
        if queries.tolist() != [context_len - 1] or scores is None:
            raise PolicyError(f"policy {self.name} decides for the target's query of a prefill (--semantics prefill_evict)")
        layers, kv = scores
        return head_kept(self.head_index(budget, layers, kv), context_len, queries)  # heads [L, B, H, k-1]


def score_layer(press, layers, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layer: int, where: str = "") -> torch.Tensor:
    """[B, H_kv, T - 1] scores of layer ``layer``'s prefill keys by ``press`` (``press.score`` with the
    layer's module, input hidden states, keys, values, no attention weights and its keyword arguments;
    the module gets the model's rotary embedding for the call, as kvpress's hook gives it).

    Args:
        press: a kvpress ``ScorerPress`` instance; layers, kv: as :meth:`KVPressPolicy.head_index`;
        where: words for the error message (e.g. "at budget 64").

    Raises:
        PolicyError: the press refuses to score (its own checks).
    """
    module = layers.modules[layer]
    keys, values = kv[layer]  # [B, H, T-1, d]
    rotary = getattr(getattr(layers.model, "model", None), "rotary_emb", None)
    added = rotary is not None and not hasattr(module, "rotary_emb")
    if added:  # kvpress's hook gives every attention module the model's rotary embedding
        module.rotary_emb = rotary
    try:
        return press.score(module, layers.hidden_states[layer], keys, values, None, layers.kwargs[layer])
    except (AssertionError, ValueError, NotImplementedError) as exc:  # the press's own checks
        raise PolicyError(f"press {type(press).__name__} cannot score layer {layer} {where}: {exc}") from None
    finally:
        if added:
            del module.rotary_emb


def n_kept(prefix: int, ratio: float) -> int:
    """Keys kvpress keeps of ``prefix`` prefill keys at ``compression_ratio = ratio`` (its
    ``compute_n_kept``, kvpress 0.5.5): all at 0, none at >= 1, else ``max(1, int(prefix (1 - ratio)))``."""
    if ratio == 0:
        return prefix
    return 0 if ratio >= 1 else max(1, int(prefix * (1 - ratio)))


@torch.no_grad()
def per_layer_head_index(press, ratios: Sequence[float], layers, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Kept prefix positions per layer and key/value head when ``press`` runs inside kvpress's
    ``PerLayerCompressionPress(press, compression_ratios=ratios)``: layer l scores its keys with the
    press's ``compression_ratio`` set to ``ratios[l]`` (restored afterwards, as the wrapper does) and
    keeps its :func:`n_kept` keys of highest score (``scores.topk``).

    This is the scorer's side of the wrapper, layer by layer: kvpress's own hook path for
    ``PerLayerCompressionPress`` runs only with FlashAttention, so on other back-ends the kept sets
    come from here (the ``truncsens plan`` JSON's ``kvpress_compression_ratios`` are checked this way
    in tests/test_kvpress_plan.py).

    Args:
        press: a kvpress ``ScorerPress`` instance; ratios: L compression ratios in [0, 1);
        layers, kv: as :meth:`KVPressPolicy.head_index` (prefill of T - 1 tokens).

    Returns:
        L tensors [B, H_kv, n_l] int64, increasing along the last dim (n_l may differ by layer).

    Raises:
        PolicyError: a ratio count other than L, a ratio outside [0, 1), or the press refuses to score.
    """
    if len(ratios) != len(layers.modules):
        raise PolicyError(f"{len(ratios)} compression ratios for a model of {len(layers.modules)} layers")
    if any(not 0 <= r < 1 for r in ratios):
        raise PolicyError(f"compression ratios must lie in [0, 1), got {list(ratios)}")
    press.post_init_from_model(layers.model)
    original = press.compression_ratio
    out = []
    try:
        for layer, ratio in enumerate(ratios):
            press.compression_ratio = ratio
            scores = score_layer(press, layers, kv, layer, f"at compression ratio {ratio:g}")  # [B, H, T-1]
            top = scores.topk(n_kept(scores.shape[-1], ratio), dim=-1).indices  # [B, H, n_l]
            out.append(torch.sort(top, dim=-1).values)
    finally:
        press.compression_ratio = original
    return out


def check_policy_args(classes: Sequence[type], args: dict | None) -> None:
    """Refuse ``--policy-arg`` keys that none of the run's kvpress policies takes.

    Args:
        classes: the run's policy classes; args: the parsed ``--policy-arg`` values.

    Raises:
        PolicyError: arguments without a kvpress policy, or a key no press of the run has (the
            message lists their parameters).
    """
    if not args:
        return
    presses = [c for c in classes if isinstance(c, type) and issubclass(c, KVPressPolicy)]
    if not presses:
        raise PolicyError(f"policy_args (--policy-arg) sets parameters of {PREFIX}<PressClass> policies; none is given")
    known = set().union(*(c.parameters() for c in presses))
    unknown = sorted(set(args) - known - {"compression_ratio"})
    if unknown:
        names = ", ".join(c.press for c in presses)
        raise PolicyError(f"policy_args (--policy-arg) {', '.join(unknown)}: no parameter of press {names}; "
                          f"their parameters: {', '.join(sorted(known)) or 'none'}")


def kvpress_policy_class(name: str) -> type[KVPressPolicy]:
    """The policy class of ``kvpress:<PressClass>`` (a :class:`KVPressPolicy` subclass named so).

    Raises:
        PolicyError: see :func:`press_class`, or a name without a press.
    """
    press = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if not press:
        raise PolicyError(f"{PREFIX} needs a press class, e.g. {PREFIX}KnormPress")
    press_class(press)
    return type(f"KVPress_{press}", (KVPressPolicy,), {"name": PREFIX + press, "press": press, "__module__": __name__})
