"""Progress for long work: a live bar on a terminal, a plain log line now and then elsewhere.

Cluster job logs and CI logs are files: a bar redrawn with carriage returns would fill them with
hundreds of frames. There the same bar is written as one ordinary log line (logger
``wsi_pipeline.progress``, level INFO) at most every ``log_every`` seconds, and once at the end.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["progress_bar"]

log = logging.getLogger(__name__)


#: Terminal control sequences (cursor moves of nested bars) that have no place in a log file.
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _LogLines:
    """A file-like sink for tqdm that turns each redraw into one log line."""

    def write(self, text: str) -> None:
        line = _ESCAPES.sub("", text.replace("\r", "")).strip()
        if line:
            log.info(line)

    def flush(self) -> None:
        pass


def progress_bar(
    iterable: Iterable[Any] | None = None, *, enabled: bool = True, log_every: float = 30.0, **kwargs: Any
) -> Any:
    """A tqdm bar over ``iterable`` (or a manual one with ``total=``).

    Parameters
    ----------
    enabled : False shows nothing (``--no-progress``).
    log_every : seconds between log lines when standard error is not a terminal.
    kwargs : tqdm's (``desc``, ``total``, ``unit``, ``leave``, ...).
    """
    from tqdm.auto import tqdm

    if not enabled:
        return tqdm(iterable, disable=True, **kwargs)
    if sys.stderr.isatty():
        return tqdm(iterable, dynamic_ncols=True, **kwargs)
    return _log_bar_class()(iterable, file=_LogLines(), mininterval=log_every, maxinterval=log_every, ncols=100,
                            ascii=True, **kwargs)


def _log_bar_class() -> type:
    """tqdm whose ``set_postfix`` / ``set_description`` never force a redraw: off a terminal a redraw is a
    log line, and a loop that sets a postfix per item (the training loss per bag) would log every item."""
    from tqdm.auto import tqdm

    class _LogBar(tqdm):
        def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
            super().set_postfix(ordered_dict, refresh=False, **kwargs)

        def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
            super().set_description(desc, refresh=False)

        def close(self) -> None:
            # the last periodic line may be minutes old: log the final count and postfix (the epoch's
            # loss), so the last line a log file shows holds the final values. A bar that is left
            # (``leave``) gets that line from tqdm's own close; one that is not would only be cleared.
            if not self.disable and self.n and self.last_print_n != self.n and not self.leave:
                self.refresh()
            super().close()

    return _LogBar
