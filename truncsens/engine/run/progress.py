"""Progress of the steps that take long besides a run's shards (loading a model, tokenizing a corpus,
fitting with a thousand bootstrap resamples), on stderr only, so stdout's tables stay as they are:
a tqdm bar over the stages on a terminal, one line per stage when stderr is a file or a pipe (a
log: no carriage-return frames), nothing when disabled. The shards' own progress is
:class:`truncsens.engine.run.shards.ShardProgress`."""

from __future__ import annotations

import sys


def say(desc: str, text: str, enabled: bool = True) -> None:
    """One line ``desc: text`` on stderr (terminal or log alike) when ``enabled``."""
    if enabled:
        print(f"{desc}: {text}", file=sys.stderr, flush=True)


class StageProgress:
    """Stages of one step, announced as each begins: :meth:`stage` ``(what, index, total)``.

    On a terminal a tqdm bar of ``total`` stages shows the current one; in a log each stage is one
    line ``desc: what (index/total)``. Used as a context manager (the bar is closed on exit), or
    passed as the ``on_stage`` callback of :func:`truncsens.fits.fitting.fit_datasets`.
    """

    def __init__(self, desc: str, enabled: bool = True) -> None:
        self.desc, self.enabled = desc, enabled
        self.interactive = enabled and sys.stderr.isatty()
        self.bar = None

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)  # the last stage is done
            self.bar.close()
            self.bar = None

    def __call__(self, what: str, index: int, total: int) -> None:
        self.stage(what, index, total)

    def stage(self, what: str, index: int, total: int) -> None:
        """Stage ``index`` of ``total`` (from 1), ``what``, begins; the ones before it are done."""
        if not self.enabled:
            return
        if not self.interactive:
            print(f"{self.desc}: {what} ({index}/{total})", file=sys.stderr, flush=True)
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="stage", file=sys.stderr)
        self.bar.update(index - 1 - self.bar.n)
        self.bar.set_postfix_str(what)
