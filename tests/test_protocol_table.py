"""benchmarks/protocol_table.py: the exact and block protocol runs of protocol_efficiency.py's summaries as
one Markdown table (3 decimals), a results file read by several summaries printed once, then the paired differences and width models."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("protocol_table", Path(__file__).parents[1] / "benchmarks" / "protocol_table.py")
table = importlib.util.module_from_spec(SPEC)
sys.modules["protocol_table"] = table
SPEC.loader.exec_module(table)


def run(targets, tokens, a_tv, ci_tv, a_kl, ci_kl, **extra):
    return {"targets": targets, "docs": 47, "forward_tokens": tokens, "alpha_tv": a_tv, "alpha_tv_ci": ci_tv,
            "alpha_kl": a_kl, "alpha_kl_ci": ci_kl, **extra}


def test_a_table_of_runs_then_differences_and_width_models(tmp_path, capsys):
    first = {"exact": run(376, 769672, 0.42474, [0.38859, 0.46640], 0.62149, [0.54159, 0.72882]),
             "block": run(376, 106690, 0.41223, [0.36426, 0.46930], 0.66867, [0.58356, 0.80254]),
             "alpha_tv_difference_same_targets": {"value": -0.0031, "ci": [-0.00854, 0.00179], "agree": True},
             "fixed_documents_tv": {"a": 0.0006017, "b": 0.041581, "m_star": 13.26, "ratio": 5.1208}}
    second = {"exact": run(376, 769672, 0.42474, [0.38859, 0.46640], 0.62149, [0.54159, 0.72882], reused="runs/pe8/exact.nc"),
              "block": run(2943, 249111, 0.41659, [0.38779, 0.44892], 0.67021, [0.61687, 0.73058]),
              "alpha_kl_difference": {"value": 0.0489, "ci": [-0.0536, 0.1296], "agree": False}}
    for name, summary in (("pe8", first), ("pe64", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    third = {"exact": run(1488, 3045936, 0.41503, [0.39385, 0.44198], 0.67798, [0.63687, 0.72775], reused="runs/exact32.nc"),
             "block": {**second["block"], "reused": "runs/pe64/block.nc"}}
    for name, summary in (("pe32", third),):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert table.main([str(tmp_path / n / "summary.json") for n in ("pe8", "pe64", "pe32")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| run: protocol | targets | forward tokens | α_TV (95 % CI) | α_KL (95 % CI) |",
        "|---|---|---|---|---|",
        "| pe8: exact, 8 random targets / document | 376 | 769,672 | 0.425 [0.389, 0.466] | 0.621 [0.542, 0.729] |",
        "| pe8: block, 8 targets in blocks / document | 376 | 106,690 | 0.412 [0.364, 0.469] | 0.669 [0.584, 0.803] |",
        "| pe64: block, 62.6 targets in blocks / document | 2,943 | 249,111 | 0.417 [0.388, 0.449] | 0.670 [0.617, 0.731] |",
        "| pe32: exact, 31.7 random targets / document | 1,488 | 3,045,936 | 0.415 [0.394, 0.442] | 0.678 [0.637, 0.728] |",
        "",
        "pe8: α_TV block − exact on the same targets: -0.003 [-0.009, +0.002] (agree)",
        "pe8: α_TV widths: W² = 0.0006 + 0.0416/m; exact needs m* = 13.3 targets / document for the block's width, "
        "costing 5.1x the block's forward tokens",
        "pe64: α_KL block − exact on their own targets: +0.049 [-0.054, +0.130] (differ)",
    ]


def test_a_missing_summary_is_named(tmp_path):
    with pytest.raises(SystemExit, match="nope.json: no such summary"):
        table.main([str(tmp_path / "nope.json")])
