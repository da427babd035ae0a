"""The block protocol's passes (``truncsens measure --protocol block``): K consecutive targets per
forward pass, plans from :mod:`truncsens.engine.block.plan`.

Each pass is a plain causal forward over a contiguous stretch of the document (sinks in front),
with an all-ones [B, L] padding mask and explicit position ids: no [L, L] mask is built here, so
the model's attention implementation (SDPA memory-efficient or FlashAttention kernels on a GPU, see
:func:`choose_attention`) runs its causal kernel. The last k positions' logits give the k targets
of the pass (``logits_to_keep=k``); log-softmax in float64 from float32 logits as everywhere
(:func:`truncsens.engine.forward.last_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from truncsens.engine.attention_features import attention_features
from truncsens.engine.batching import run_in_batches
from truncsens.engine.block.plan import (
    Blocks, actual_contexts, actual_windows, blocks_of, chunks, extra_context, targets_per_pass,
)
from truncsens.engine.errors import MeasureError
from truncsens.engine.forward import rows_logprobs
from truncsens.engine.kernel import metric_arrays, store_metrics
from truncsens.targets import TargetSet


@dataclass
class BlockOutput:
    """What :func:`measure_blocks` returns (n targets, S windows).

    Attributes:
        metrics: name -> [n, S], each in its record's dtype (:mod:`truncsens.metrics`: float32,
            ``top1_agree`` int8).
        actual_window: [n, S] int64 tokens of window each measurement read (sinks not counted).
        actual_context: [n] int64 tokens of each target's reference context.
        n_clamped: values clamped for rounding noise.
        forward_tokens: tokens of every forward pass run.
    """

    metrics: dict[str, np.ndarray]
    actual_window: np.ndarray
    actual_context: np.ndarray
    n_clamped: int = 0
    forward_tokens: int = 0


def choose_attention(model, device: str) -> str:
    """Pick the attention kernel of long passes and return its name (recorded in the results attr
    ``attention_implementation``): on CUDA ``flash_attention_2`` when the ``flash_attn`` package is
    installed, else ``sdpa`` (PyTorch picks its memory-efficient or flash kernel); elsewhere the
    model's own implementation is kept, and so it is for a model whose attention has a feature those
    kernels drop (soft-capping, learned sinks, ALiBi: :mod:`truncsens.engine.attention_features`).
    A model that is not a transformers model reports "n/a"."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current is None or not hasattr(model, "set_attn_implementation"):
        return "n/a"
    if torch.device(device).type != "cuda" or current in ("flash_attention_2", "sdpa") or attention_features(model):
        return current
    import importlib.util

    wanted = "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"
    try:
        model.set_attn_implementation(wanted)
    except (ValueError, ImportError):  # the architecture lacks it: keep what it has
        return current
    return wanted


def check_block_model(model, name: str) -> None:
    """The block protocol reads several targets from one causal pass, which a model with
    sliding-window layers on original positions would not give exactly.

    Raises:
        MeasureError: the model has sliding-window layers.
    """
    if hasattr(model, "set_attn_implementation"):
        from truncsens.engine.attention_windows import WindowError, layer_windows

        try:
            windowed = layer_windows(model).windowed
        except WindowError:
            windowed = True
        if windowed:
            raise MeasureError(f"model {name!r} has sliding-window attention layers; --protocol block needs full "
                               "causal attention in every layer: use --protocol exact")


def pass_logprobs(model, ids: torch.Tensor, pos: torch.Tensor, keep: int) -> torch.Tensor:
    """Log-probabilities after each of the last ``keep`` tokens of every row.

    Args:
        ids, pos: [P, L] int64 token ids and position ids.
        keep: k <= L.

    Returns:
        [P, k, V] float64 log-softmax.

    Raises:
        NonFiniteLogitsError: NaN or infinite logits.
    """
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos, use_cache=False,
                logits_to_keep=keep)
    return rows_logprobs(out.logits, keep)  # [P, k, V]


@dataclass(frozen=True)
class PassGroup:
    """Passes of equal length: for each, the block row it reads (x[t0-N : t0+B-1] of its block,
    see :func:`block_rows`), the columns of that row, the position ids and the targets it measures.

    Attributes:
        row: [P] int64 block index; cols: [P, L] int64 columns of that block's row; pos: [P, L]
            int64 position ids; targets: [P, k] int64 target indices (the last k positions of each pass).
    """

    row: torch.Tensor
    cols: torch.Tensor
    pos: torch.Tensor
    targets: torch.Tensor


def block_rows(context: torch.Tensor, token_id: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """[b, N + B - 1] int64 tokens x[t0-N : t0+size-1] of every block (t0 its first target; the
    first target's context followed by the block's target tokens but the last), zero-padded to the
    largest block B. Column c holds document position t0 - N + c."""
    n_blocks, N = len(blocks.size), context.shape[1]
    rows = torch.zeros(n_blocks, N + int(blocks.size.max()) - 1, dtype=context.dtype, device=context.device)
    for i, (start, size) in enumerate(zip(blocks.start.tolist(), blocks.size.tolist())):
        rows[i, :N] = context[start]
        rows[i, N : N + size - 1] = token_id[start : start + size - 1]
    return rows


def reference_passes(blocks: Blocks, reference_context: int, room: int) -> list[PassGroup]:
    """One reference pass per block, grouped by block size: columns ``size-1-e .. N+size-2`` of the
    block row (x[r : t0+size-1]), positions 0 .. N+e-1, all ``size`` targets."""
    N = reference_context
    groups: dict[int, list] = {}
    for i, (start, size) in enumerate(zip(blocks.start.tolist(), blocks.size.tolist())):
        e = extra_context(size, room)
        cols = list(range(size - 1 - e, N + size - 1))
        groups.setdefault(size, []).append((i, cols, list(range(len(cols))), list(range(start, start + size))))
    return [_group(groups[k]) for k in sorted(groups)]


def window_passes(blocks: Blocks, reference_context: int, window: int, per_pass: int, n_sink: int, positions: str,
                  room: int) -> list[PassGroup]:
    """The passes of one window, grouped by length (module docstring of :mod:`truncsens.engine.block.plan`):
    the sinks x[r : r+S] and x[tc-w : tc+k-1] of each chunk, at positions (document position - r)
    under ``original``, 0 .. L-1 under ``reindexed``."""
    N = reference_context
    groups: dict[int, list] = {}
    for i, (start, size) in enumerate(zip(blocks.start.tolist(), blocks.size.tolist())):
        r_col = size - 1 - extra_context(size, room)  # column of x[r]
        for a, b in chunks(size, per_pass):
            k = b - a
            cols = [*range(r_col, r_col + n_sink), *range(N + a - window, N + a + k - 1)]  # [S + w + k - 1]
            pos = [c - r_col for c in cols] if positions == "original" else list(range(len(cols)))
            groups.setdefault(k, []).append((i, cols, pos, list(range(start + a, start + b))))
    return [_group(groups[k]) for k in sorted(groups)]


def _group(items: list) -> PassGroup:
    rows, cols, pos, targets = zip(*items)
    return PassGroup(torch.tensor(rows), torch.tensor(cols), torch.tensor(pos), torch.tensor(targets))


@torch.no_grad()
def measure_blocks(
    model, targets: TargetSet, windows: Sequence[int], n_sink: int, positions: str, block_fraction: float,
    block_size: int, device: str, max_batch_tokens: int, on_tokens: Callable[[int], None] | None = None,
    room: int = 0,
) -> BlockOutput:
    """Metrics of every (target, window) by the block protocol.

    Args:
        model: causal LM on ``device`` (full attention in every layer).
        targets: n targets in blocks (``targets.block`` set; :func:`truncsens.targets.select_block_targets`),
            contexts [n, N].
        windows: S windows, each checked by :func:`truncsens.engine.block.plan.check_block_windows`.
        n_sink: sinks kept in front of every window; positions: "original" or "reindexed".
        block_fraction, block_size: K(w) of :func:`truncsens.engine.block.plan.targets_per_pass`.
        max_batch_tokens: token budget of one forward pass; on_tokens: progress (forward tokens).
        room: positions the model has beyond N (its maximum context - N); reference passes read up
            to ``min(B - 1, room)`` more tokens (:func:`truncsens.engine.block.plan.extra_context`).

    Returns:
        :class:`BlockOutput`.

    Raises:
        ValueError: targets without blocks, or a block that is not consecutive.
        NonFiniteLogitsError: NaN or infinite logits.
    """
    n, N = targets.context.shape
    S = len(windows)
    metrics = metric_arrays((n, S))
    if targets.block is None:
        raise ValueError("the block protocol needs targets drawn in blocks (select_block_targets)")
    blocks = blocks_of(targets.doc, targets.position, targets.block)
    out = BlockOutput(metrics, np.zeros((n, S), np.int64), actual_contexts(blocks, N, room))
    if n == 0:
        return out
    rows = block_rows(targets.context, targets.token_id, blocks).to(device)  # [b, N + B - 1]
    token_id = targets.token_id.to(device)  # [n]
    store: dict[str, torch.Tensor] = {}

    def run(group: PassGroup, j: int | None) -> None:
        k = group.targets.shape[1]

        def step(sl: slice) -> None:
            ids = rows[group.row[sl].to(device)].gather(1, group.cols[sl].to(device))  # [P, L]
            lp = pass_logprobs(model, ids, group.pos[sl].to(device), k)  # [P, k, V]
            lp = lp.reshape(-1, lp.shape[-1])  # [P*k, V]
            idx = group.targets[sl].reshape(-1).to(device)  # [P*k]
            if j is None:  # reference pass
                if "ref" not in store:
                    store["ref"] = torch.empty(n, lp.shape[-1], dtype=lp.dtype, device=device)
                store["ref"][idx] = lp
            else:
                out.n_clamped += store_metrics(metrics, (idx.cpu().numpy(), j), store["ref"][idx], lp, token_id[idx])
            out.forward_tokens += ids.numel()
            if on_tokens:
                on_tokens(ids.numel())

        run_in_batches(step, group.row.shape[0], group.cols.shape[1], max_batch_tokens)

    for group in reference_passes(blocks, N, room):
        run(group, None)
    for j, w in enumerate(windows):
        per_pass = targets_per_pass(w, block_fraction, block_size)
        out.actual_window[:, j] = actual_windows(blocks, w, per_pass)
        for group in window_passes(blocks, N, w, per_pass, n_sink, positions, room):
            run(group, j)
    return out
