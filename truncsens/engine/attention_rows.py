"""Attention statistics a retention policy reads, kept as a few query rows instead of a T × T matrix.

The reference pass (:func:`truncsens.engine.reference_pass.reference_pass`) serves every
attention-derived score from two kinds of statistic, both means over layers and heads (or over
layers and the query heads of each key/value head, ``heads=Hkv``, docs/method.md "Granularity"):

- **rows**: the attention row ``a_i = (a_{i,0} .. a_{i,T-1})`` of a few query positions i (the
  target queries' own rows, the previous query's row for TOVA, an observation window for SnapKV);
- **cumulative**: ``Σ_{i <= q} a_i`` at a few query positions q (accumulated attention, H2O and
  Poisson's attention score);
- **layer windows**: per layer and key/value head (not averaged over layers), the mean of the rows
  of an observation window ``q - w .. q - 1`` over its w queries and the group's query heads
  (SnapKV as published, arXiv 2404.14469, and kvpress's ``SnapKVPress``: one kept set per layer and
  head); memory L · B · Hkv · T floats per window, only the window's rows computed.

:class:`AttentionNeeds` says which positions a run needs; :class:`AttentionRows` holds them;
:class:`RowAccumulator` builds them from one layer's queries and keys at a time, computing softmax
rows in blocks (memory O(block · T), never T × T), as the attention function the model calls
(:mod:`truncsens.engine.score_attention`). :meth:`AttentionRows.of_matrix` gives the same object
from a full matrix (the eager fallback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

BLOCK_ELEMENTS = 1 << 21  # softmax elements of one block of query rows on CPU (8 MiB in float32)
DEVICE_BLOCK_ELEMENTS = 1 << 25  # on an accelerator (128 MiB): fewer, larger kernels
MAX_BLOCK_ROWS = 256  # query rows of one block at most


@dataclass(frozen=True)
class AttentionNeeds:
    """Which statistics a reference pass collects.

    Attributes:
        rows: sorted query positions whose attention rows are kept.
        cumulative: sorted query positions q at which the accumulated attention ``Σ_{i<=q} a_i`` is kept.
        windows: sorted (q, w) pairs: observation windows of the queries ``max(0, q - w) .. q - 1``
            whose mean row is kept per layer and key/value head (:meth:`AttentionRows.layer_window`).
    """

    rows: tuple[int, ...] = ()
    cumulative: tuple[int, ...] = ()
    windows: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, rows=(), cumulative=(), windows=()) -> "AttentionNeeds":
        """Sorted, deduplicated positions (any iterable of ints; ``windows``: of (q, w) pairs).

        Raises:
            ValueError: a window of fewer than 1 query.
        """
        spans = tuple(sorted({(int(q), int(w)) for q, w in windows}))
        if any(w < 1 for _, w in spans):
            raise ValueError(f"observation windows need at least 1 query, got {[w for _, w in spans]}")
        return cls(tuple(sorted({int(r) for r in rows})), tuple(sorted({int(c) for c in cumulative})), spans)

    def __or__(self, other: "AttentionNeeds") -> "AttentionNeeds":
        return AttentionNeeds.of(self.rows + other.rows, self.cumulative + other.cumulative,
                                 self.windows + other.windows)

    def window_rows(self) -> tuple[int, ...]:
        """Sorted query positions the :attr:`windows` cover."""
        return tuple(sorted({i for q, w in self.windows for i in range(max(0, q - w), q)}))


def _lookup(positions: torch.Tensor, wanted: torch.Tensor, what: str) -> torch.Tensor:
    """[Q] indices of ``wanted`` [Q] in the sorted ``positions`` [R]; ValueError for one not there."""
    wanted = wanted.to(positions.device)
    idx = torch.searchsorted(positions, wanted).clamp(max=max(positions.numel() - 1, 0))  # [Q]
    if positions.numel() == 0 or bool((positions[idx] != wanted).any()):
        missing = sorted(set(wanted.tolist()) - set(positions.tolist()))
        raise ValueError(f"the reference pass did not collect the attention {what} of queries {missing[:8]}")
    return idx


@dataclass
class AttentionRows:
    """Attention rows and accumulated attention of a reference pass (module docstring).

    Attributes:
        row_pos: [R] int64 sorted query positions of ``rows``.
        rows: [B, (Hkv,) R, T] float32 attention probabilities of those queries (zeros beyond each
            query: causal), mean over layers and heads.
        cum_pos: [C] int64 sorted query positions of ``cumulative``.
        cumulative: [B, (Hkv,) C, T] float32 ``Σ_{i <= q} a_i`` at those queries.
        windows: the (q, w) pairs of ``layer_windows`` (:attr:`AttentionNeeds.windows`).
        layer_windows: [L, B, Hkv, S, T] float32 or None: for window s = (q, w), layer l and key/value
            head h, ``(1 / (w' G)) Σ_{i = q - w'}^{q - 1} Σ_{g < G} a^{(l, hG + g)}_{i, j}`` with
            w' = min(w, q) and G = H / Hkv (zeros for keys j > i of each row: causal).
    """

    row_pos: torch.Tensor
    rows: torch.Tensor
    cum_pos: torch.Tensor
    cumulative: torch.Tensor
    windows: tuple[tuple[int, int], ...] = ()
    layer_windows: torch.Tensor | None = None

    @classmethod
    def of_matrix(cls, attention: torch.Tensor, needs: AttentionNeeds | None = None) -> "AttentionRows":
        """The rows and accumulated rows of a full matrix ``attention`` [B, (Hkv,) T, T] (the eager
        fallback): those ``needs`` names, or every one (None; memory 2 · B · T² floats)."""
        T = attention.shape[-1]
        pos = torch.arange(T, device=attention.device)  # [T]
        if needs is None:
            return cls(pos, attention, pos, attention.cumsum(-2))  # [B, (Hkv,) T, T] each
        rows = torch.tensor(needs.rows, dtype=torch.long, device=attention.device)  # [R]
        cum = torch.tensor(needs.cumulative, dtype=torch.long, device=attention.device)  # [C]
        cumulative = attention.cumsum(-2).index_select(-2, cum) if cum.numel() else attention[..., :0, :]  # [B, (Hkv,) C, T]
        return cls(rows, attention.index_select(-2, rows), cum, cumulative)

    def row(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, (Hkv,) Q, T] attention rows of the query positions ``positions`` [Q] int64.

        Raises:
            ValueError: a position whose row was not collected.
        """
        return self.rows.index_select(-2, _lookup(self.row_pos, positions, "rows"))

    def accumulated(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, (Hkv,) Q, T] accumulated attention ``Σ_{i <= q} a_i`` at the query positions ``positions`` [Q].

        Raises:
            ValueError: a position whose accumulated attention was not collected.
        """
        return self.cumulative.index_select(-2, _lookup(self.cum_pos, positions, "accumulated over queries"))

    def layer_window(self, query: int, width: int) -> torch.Tensor:
        """[L, B, Hkv, T] mean attention row of the observation window ``max(0, query - width) .. query - 1``,
        per layer and key/value head (:attr:`layer_windows`).

        Raises:
            ValueError: the window was not collected.
        """
        if self.layer_windows is None or (query, width) not in self.windows:
            raise ValueError(f"the reference pass did not collect the observation window of {width} queries "
                             f"before query {query} per layer and key/value head")
        return self.layer_windows[:, :, :, self.windows.index((query, width))]

    def prefix(self, c: int) -> "AttentionRows":
        """The statistics of a ``c``-token reference: queries < c, keys < c (causal attention: equal)."""
        r, k = self.row_pos < c, self.cum_pos < c  # [R], [C] bool
        spans = [s for s, (q, _) in enumerate(self.windows) if q < c]
        windows = None if self.layer_windows is None else self.layer_windows[:, :, :, spans, :c]  # [L, B, Hkv, S', c]
        return AttentionRows(self.row_pos[r], self.rows[..., r, :c], self.cum_pos[k], self.cumulative[..., k, :c],
                             tuple(self.windows[s] for s in spans), windows)

    def fold(self) -> "AttentionRows":
        """Per-head statistics [B, Hkv, *, T] with heads folded into rows [B·Hkv, *, T] (row b·Hkv + h)."""
        def fold(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # [B, Hkv, R, T] -> [B·Hkv, R, T]

        return AttentionRows(self.row_pos, fold(self.rows), self.cum_pos, fold(self.cumulative), self.windows,
                             self.layer_windows)


class RowAccumulator:
    """Sums attention rows over layers and heads, one layer call at a time, in blocks of query rows.

    Args:
        needs: the rows and accumulated rows to collect.
        width: T, keys of the longest call (the statistics' last dimension; shorter calls fill a prefix).
        kv_heads: None (sum over all heads) or Hkv (sum over each key/value head's query heads).
        block_elements: softmax elements of one block (rows per block = this / (B · H · keys), at most
            :data:`MAX_BLOCK_ROWS`, at least 1): the memory of one block, whatever T (about two blocks
            of float32 are alive at once); None: :data:`BLOCK_ELEMENTS` on CPU,
            :data:`DEVICE_BLOCK_ELEMENTS` elsewhere.
    """

    def __init__(self, needs: AttentionNeeds, width: int, kv_heads: int | None = None,
                 block_elements: int | None = None) -> None:
        self.needs, self.width, self.kv_heads, self.block_elements = needs, width, kv_heads, block_elements
        self.row_pos = torch.tensor(needs.rows, dtype=torch.long)  # [R]
        self.cum_pos = torch.tensor(needs.cumulative, dtype=torch.long)  # [C]
        self.rows: torch.Tensor | None = None  # [B, (Hkv,) R, T] sums
        self.shared: torch.Tensor | None = None  # [B, (Hkv,) T] sums of the rows before the first cumulative query
        self.partial: torch.Tensor | None = None  # [B, (Hkv,) C, T] sums of the later rows up to each query
        self.layers: dict[int, int] = {}  # ids of the attention modules seen -> layer index (first-call order)
        self.per_layer = 0  # heads summed per layer (H, or H / Hkv)
        self.groups = 0  # G = H / Hkv, query heads per key/value head
        self.window_pos = torch.tensor(needs.window_rows(), dtype=torch.long)  # [W] rows the windows cover
        lo = torch.tensor([max(0, q - w) for q, w in needs.windows], dtype=torch.long)  # [S] first row of each window
        hi = torch.tensor([q for q, _ in needs.windows], dtype=torch.long)  # [S] one past its last row
        self.window_span = (lo, hi)
        self.windows: list[torch.Tensor] = []  # per layer [B, Hkv, S, T] sums over window rows and group heads

    def _zeros(self, batch: int, *mid: int, device) -> torch.Tensor:
        head = () if self.kv_heads is None else (self.kv_heads,)
        return torch.zeros(batch, *head, *mid, self.width, dtype=torch.float32, device=device)

    def add(self, module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float,
            sliding_window: int | None = None, softcap: float | None = None) -> None:
        """Add one layer call's attention rows.

        Args:
            module: the attention module (layers are counted by identity).
            query: [B, H, Tq, d] queries at positions ``Tk - Tq .. Tk - 1`` (after rotary embedding).
            key: [B, Hkv, Tk, d] every key of the layer (cache included), not repeated over groups.
            mask: None (causal, then ``sliding_window`` if given), or the layer's 4D mask
                [B or 1, 1 or H, Tq, >= Tk], bool (True: attend) or float (added to the logits).
            scaling: logit scale; softcap: ``tanh(s / c) · c`` of the logits before the mask (Gemma 2).

        Raises:
            ValueError: H not a multiple of Hkv, or more keys than ``width``.
        """
        B, H, Tq, d = query.shape
        Hkv, Tk = key.shape[1], key.shape[2]
        if H % Hkv or Tk > self.width:
            raise ValueError(f"attention rows: {H} query heads over {Hkv} key heads, {Tk} keys of at most {self.width}")
        G, p0 = H // Hkv, Tk - Tq
        layer = self.layers.setdefault(id(module), len(self.layers))
        self.per_layer = H if self.kv_heads is None else G
        self.groups = G
        device = query.device
        pos = torch.arange(p0, Tk, device=device)  # [Tq] positions of this call's queries
        row_pos, cum_pos = self.row_pos.to(device), self.cum_pos.to(device)
        window_pos = self.window_pos.to(device)
        in_rows = torch.isin(pos, row_pos)  # [Tq] rows the layer-mean statistics read
        if cum_pos.numel():
            in_rows |= pos <= cum_pos[-1]
        in_windows = torch.isin(pos, window_pos)  # [Tq] rows of the observation windows
        if self.rows is None:
            self.rows = self._zeros(B, row_pos.numel(), device=device)
            self.shared = self._zeros(B, device=device)
            self.partial = self._zeros(B, cum_pos.numel(), device=device)
        if self.needs.windows:
            while len(self.windows) <= layer:
                self.windows.append(torch.zeros(B, Hkv, len(self.needs.windows), self.width, dtype=torch.float32,
                                                device=self.rows.device))
        if not bool((in_rows | in_windows).any()):
            return
        keys = key.float().unsqueeze(2).transpose(-1, -2)  # [B, Hkv, 1, d, Tk]
        budget = self.block_elements or (BLOCK_ELEMENTS if device.type == "cpu" else DEVICE_BLOCK_ELEMENTS)
        step = max(1, min(MAX_BLOCK_ROWS, budget // max(1, B * H * Tk)))

        def blocks(rows: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            """(local query rows [n], their softmax rows [B, Hkv, G, n, Tk]) in blocks of ``step`` rows."""
            for start in range(0, rows.numel(), step):
                idx = rows[start : start + step]  # [n] local query rows
                q = query[:, :, idx].float().reshape(B, Hkv, G, idx.numel(), d)  # [B, H, n, d] -> [B, Hkv, G, n, d]
                s = torch.matmul(q, keys).mul_(scaling)  # [B, Hkv, G, n, Tk]; in place: one block of logits alive
                if softcap:
                    s.div_(softcap).tanh_().mul_(softcap)
                _mask_(s, mask, idx, pos[idx], Tk, sliding_window)
                yield idx, torch.softmax(s, dim=-1)  # [B, Hkv, G, n, Tk]

        # the layer-mean rows first, in the blocks they always had; then the rows only the windows read
        for idx, p in blocks(in_rows.nonzero().flatten()):
            if self.needs.windows and bool(in_windows[idx].any()):
                self._collect_windows(p.sum(2), pos[idx], layer, Tk)  # [B, Hkv, n, Tk] sums over group heads
            p = p.sum(2) if self.kv_heads is not None else p.sum((1, 2))  # [B, Hkv, n, Tk] or [B, n, Tk]
            self._collect(p, pos[idx], row_pos, cum_pos, Tk)
        for idx, p in blocks((in_windows & ~in_rows).nonzero().flatten()):
            self._collect_windows(p.sum(2), pos[idx], layer, Tk)

    def _collect(self, p: torch.Tensor, qpos: torch.Tensor, row_pos: torch.Tensor, cum_pos: torch.Tensor,
                 Tk: int) -> None:
        """Add a block ``p`` [B, (Hkv,) n, Tk] of rows at positions ``qpos`` [n] to the sums (on the
        device of the first layer's call: layers split over devices add into one place)."""
        device = self.rows.device
        p, qpos, row_pos, cum_pos = p.to(device), qpos.to(device), row_pos.to(device), cum_pos.to(device)
        hit = torch.isin(qpos, row_pos)  # [n]
        if bool(hit.any()):
            at = torch.searchsorted(row_pos, qpos[hit])  # [h] indices into the kept rows
            self.rows[..., at, :Tk] += p[..., hit, :]
        if cum_pos.numel() == 0:
            return
        early = qpos < cum_pos[0]  # [n] rows before every cumulative query: one shared sum
        if bool(early.any()):
            self.shared[..., :Tk] += p[..., early, :].sum(-2)
        late = ~early & (qpos <= cum_pos[-1])
        if bool(late.any()):
            upto = (qpos[late].view(1, -1) <= cum_pos.view(-1, 1)).to(p.dtype)  # [C, m] row i counts for query c
            self.partial[..., :Tk] += torch.matmul(upto, p[..., late, :])  # [C, m] @ [B, (Hkv,) m, Tk] -> [B, (Hkv,) C, Tk]

    def _collect_windows(self, p: torch.Tensor, qpos: torch.Tensor, layer: int, Tk: int) -> None:
        """Add a block ``p`` [B, Hkv, n, Tk] (sums over group heads) of rows at positions ``qpos`` [n]
        to the window sums of layer ``layer``: row i counts for window s when ``lo_s <= i < hi_s``."""
        target = self.windows[layer]  # [B, Hkv, S, T]
        p, qpos = p.to(target.device), qpos.to(target.device)
        lo, hi = (x.to(target.device) for x in self.window_span)  # [S] each
        member = ((qpos.view(1, -1) >= lo.view(-1, 1)) & (qpos.view(1, -1) < hi.view(-1, 1))).to(p.dtype)  # [S, n]
        target[..., :Tk] += torch.matmul(member, p)  # [S, n] @ [B, Hkv, n, Tk] -> [B, Hkv, S, Tk]

    def result(self) -> AttentionRows:
        """The means over layers and heads (:class:`AttentionRows`), and the window means per layer and
        key/value head (:attr:`AttentionRows.layer_windows`).

        Raises:
            RuntimeError: no layer call was added.
        """
        if self.rows is None:
            raise RuntimeError("attention rows: no attention layer call was seen")
        count = len(self.layers) * self.per_layer
        cumulative = (self.shared.unsqueeze(-2) + self.partial) / count  # [B, (Hkv,) C, T]
        windows = None
        if self.needs.windows:
            lo, hi = self.window_span
            queries = (hi - lo).clamp(min=1).to(torch.float32).to(self.rows.device)  # [S] w' rows of each window
            windows = torch.stack(self.windows) / (queries.view(1, 1, 1, -1, 1) * self.groups)  # [L, B, Hkv, S, T]
        return AttentionRows(self.row_pos.to(self.rows.device), self.rows / count, self.cum_pos.to(self.rows.device),
                             cumulative, self.needs.windows, windows)


def _mask_(s: torch.Tensor, mask: torch.Tensor | None, idx: torch.Tensor, qpos: torch.Tensor, Tk: int,
           sliding_window: int | None) -> None:
    """Apply the layer's mask, in place, to the logits ``s`` [B, Hkv, G, n, Tk] of the local query rows
    ``idx`` [n] (positions ``qpos``): its 4D mask when given, else causal (and the sliding window ``q - j < W``)."""
    B, Hkv, G, n, _ = s.shape
    if mask is None or mask.dim() != 4:
        j = torch.arange(Tk, device=s.device)  # [Tk]
        allowed = j.view(1, -1) <= qpos.view(-1, 1)  # [n, Tk]
        if sliding_window:
            allowed &= j.view(1, -1) > qpos.view(-1, 1) - sliding_window
        s.masked_fill_(~allowed, float("-inf"))
        return
    m = mask[:, :, idx, :Tk]  # [B or 1, 1 or H, n, Tk]
    m = m.reshape(m.shape[0], 1, 1, n, Tk) if m.shape[1] == 1 else m.reshape(m.shape[0], Hkv, G, n, Tk)  # [b, (Hkv, G), n, Tk]
    if m.dtype == torch.bool:
        s.masked_fill_(~m, float("-inf"))
    else:
        s.add_(m.to(s.dtype))
