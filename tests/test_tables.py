"""The one table renderer and the number formats (truncsens.report.tables)."""

from __future__ import annotations

import math

import pytest

from truncsens.report.tables import Column, fmt_bytes, fmt_estimate, fmt_interval, fmt_level, fmt_num, render_table


def test_render_table_fits_columns_and_rules_the_header():
    text = render_table([Column("a"), Column("bb", ">")], [["xyz", "1"], ["q", "22"]])
    assert text.splitlines() == ["a    bb", "---  --", "xyz   1", "q    22"]


def test_render_table_fixed_widths_overflow_and_no_header():
    text = render_table([Column("k", ">", 3), Column("v", ">", 4)], [["1", "12345"]], sep=" ", rule=False, fit=False)
    assert text.splitlines() == ["  k    v", "  1 12345"]
    assert render_table([Column("", ">", 3), Column()], [["7", "x"]], header=False, fit=False) == "  7  x"
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        render_table([Column("a")], [["1", "2"]])


def test_number_formats():
    assert fmt_num(1234.5678) == "1235" and fmt_num(0.000123456, 3) == "0.000123"
    assert fmt_num(None) == "-" and fmt_num(math.nan) == "-"
    assert fmt_num(math.inf) == "inf" and fmt_num(-math.inf) == "-inf"  # an infinite mean is shown, never hidden
    assert fmt_interval([0.12345, 2.0], 3) == " [0.123, 2]"
    assert fmt_interval(None) == "" and fmt_interval([None, 1.0]) == "" and fmt_interval([1.0, math.inf]) == ""
    assert fmt_estimate({"value": 0.52468, "ci": [0.4871, 0.5698]}) == "0.525 [0.487, 0.57]"
    assert fmt_estimate({"value": 0.5, "ci": [math.nan, 0.6]}) == "0.5"  # no interval: the value alone
    assert fmt_bytes(None) == "-" and fmt_bytes(512) == "512 B" and fmt_bytes(3 * 2**20) == "3 MiB"
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(2**31) == "2 GiB"
    assert fmt_level(0.95) == "95%" and fmt_level(0.975) == "97.5%" and fmt_level(0.9) == "90%"


def test_a_table_wider_than_the_terminal_splits_keeping_its_first_column():
    from truncsens.report.tables import set_width

    cols = [Column("name"), Column("a", ">"), Column("b", ">"), Column("c", ">")]
    rows = [["x", "1" * 10, "2" * 12, "3" * 8], ["yy", "4", "5", "6"]]
    whole = render_table(cols, rows)
    assert max(map(len, whole.splitlines())) == 40
    try:
        set_width(30)
        split = render_table(cols, rows)
        set_width(40)
        assert render_table(cols, rows) == whole  # it fits: unchanged
    finally:
        set_width(None)
    assert split == ("name           a             b\n----  ----------  ------------\nx     1111111111  222222222222\n"
                     "yy             4             5\n\nname         c\n----  --------\nx     33333333\nyy           6")
    assert render_table(cols, rows) == whole  # no width known (a pipe, a file): whole
