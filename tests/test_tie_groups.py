"""Ranking scores that are equal to float precision: one tie group, broken by position, so a kept set
does not depend on the last bits another machine's kernels compute (truncsens.policies.base)."""
from __future__ import annotations

import torch

from truncsens.policies.base import TIE_TOLERANCE, smallest_k, tie_groups, top_per_row

EPS = torch.finfo(torch.float32).eps


def test_tie_groups_by_relative_gap():
    ordered = torch.tensor([1.0, 1.0 - 2e-7, 1.0 - 5e-7, 0.5, 0.5, float("-inf"), float("-inf")], dtype=torch.float64)
    assert tie_groups(ordered, TIE_TOLERANCE).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert tie_groups(ordered, 0.0).tolist() == [0, 1, 2, 3, 3, 4, 4]


def test_top_per_row_near_ties_go_to_the_later_position():
    values = torch.tensor([[1.0, 1.0 + 3e-7, 1.0 - 2e-7, 0.5, 1.0 + 1e-3]])
    allowed = torch.ones_like(values, dtype=torch.bool)
    # 1e-3 above the group: kept first; then the three within 1e-4 of each other, the latest first
    assert top_per_row(values, allowed, 2).tolist() == [[False, False, True, False, True]]
    assert top_per_row(values, allowed, 3).tolist() == [[False, True, True, False, True]]
    # exact ties only: by value (the float32 ulps decide)
    assert top_per_row(values, allowed, 2, tolerance=0.0).tolist() == [[False, True, False, False, True]]


def test_smallest_k_near_ties_go_to_the_earlier_position():
    values = torch.tensor([[0.2 * (1 + 3e-7), 0.9, 0.2, 0.2 * (1 - 2e-7), 0.1]], dtype=torch.float64)
    allowed = torch.tensor([[True, True, True, True, True]])
    assert smallest_k(values, allowed, 2).tolist() == [[True, False, False, False, True]]
    assert smallest_k(values, allowed, 2, tolerance=0.0).tolist() == [[False, False, False, True, True]]
    # separated by more than the tolerance: by value, and the fast path agrees with the ranked one
    far = torch.tensor([[0.3, 0.1, 0.2, 0.4]], dtype=torch.float64)
    assert smallest_k(far, torch.ones_like(far, dtype=torch.bool), 2).tolist() == [[False, True, True, False]]
    assert smallest_k(far, torch.tensor([[True, False, True, True]]), 5).tolist() == [[True, False, True, True]]


def test_a_kept_set_does_not_move_with_float_noise():
    """Rows of scores like a previous-token head's (every key about 1, a few ulps apart) and ordinary
    ones: moving every score by up to 4 float32 ulps keeps every selection."""
    g = torch.Generator().manual_seed(0)
    flat = 1.0 + EPS * torch.randint(-3, 4, (64, 48), generator=g).to(torch.float32)  # [rows, T]
    spread = torch.rand(64, 48, generator=g)
    for values in (flat, spread, torch.cat([flat[:, :24], spread[:, :24]], dim=1)):
        allowed = torch.rand(values.shape, generator=g) > 0.2
        for trial in range(3):
            noise = 1 + 4 * EPS * (2 * torch.rand(values.shape, generator=torch.Generator().manual_seed(trial)) - 1)
            moved = values * noise
            for count in (1, 5, 17, 30):
                assert torch.equal(top_per_row(values, allowed, count), top_per_row(moved, allowed, count))
                assert torch.equal(smallest_k(-values.double(), allowed, count), smallest_k(-moved.double(), allowed, count))
