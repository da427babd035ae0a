"""The certify summary of a results file restricted to the documents after the first ``--skip-docs``
(in run order): coverage of the emitted certificate over every record, calibration at 80 / 90 / 95 /
99 % and tightness on held-out targets, printed as ``truncsens certify`` prints them
(:func:`truncsens.certificates.coverage_report.format_summary`). A reading of a finished run, no
measurement of its own.

The first 8 documents of the code held-out split are the development documents on which the
default sampling design was chosen (``benchmarks/certify_designs.py``); with ``--skip-docs 8`` the
summary holds only documents no design choice looked at.

Usage (seconds; the run itself about 11 minutes on 2 CPU cores):

    truncsens certify --domain code --reference-context 1024 --max-docs 47 --seed 1 --out results/certify-fresh-47.nc
    python benchmarks/certify_heldout.py results/certify-fresh-47.nc --skip-docs 8
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def heldout(ds, skip_docs: int):
    """The targets of ``ds`` whose document is not among the first ``skip_docs`` (run order).

    Raises:
        ValueError: ``skip_docs`` negative or leaving no document.
    """
    order = list(dict.fromkeys(str(d) for d in ds["doc"].values))
    if not 0 <= skip_docs < len(order):
        raise ValueError(f"--skip-docs must lie in [0, {len(order)}), got {skip_docs}")
    keep = np.isin(np.asarray(ds["doc"].values, dtype=str), order[skip_docs:])
    return ds.isel(target=np.flatnonzero(keep))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a truncsens certify results file")
    ap.add_argument("--skip-docs", type=int, default=8, help="leave out the first N documents (default 8)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    from truncsens import results
    from truncsens.certificates.coverage_report import format_summary, summarize
    from truncsens.fits.fit_file import sanitize

    try:
        ds = heldout(results.load(args.results), args.skip_docs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = summarize(ds)
    print(json.dumps(sanitize(s), indent=1, allow_nan=False) if args.json else
          f"documents after the first {args.skip_docs} of {args.results}\n" + format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
