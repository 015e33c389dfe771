"""The ``wsi-pipeline`` console script.

Every module in :mod:`wsi_pipeline.cli` that defines ``register(subparsers)`` contributes one
subcommand; ``register`` adds a parser and sets ``func`` (``Callable[[argparse.Namespace], int]``)
as its default. Heavy imports (torch, openslide) happen inside ``func``, so ``--help`` is fast.

Errors are reported here, once for every command: a user error (:data:`USER_ERRORS`: bad input,
a missing or refused file, a full, read-only or wrong output path) is one line on stderr,
``wsi-pipeline <command>: error: ...``, exit status 2 (``-vv`` adds the traceback); any other error
(a bug: ``TypeError``, ``AttributeError``, ``KeyError``, ...) propagates with its traceback, exit
status 1; Ctrl-C is one line saying how to continue, exit status 130. Exit status 1 means the command ran but some
slides (or runs) failed; each command's summary names them.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

import wsi_pipeline
from wsi_pipeline import cli as _cli_pkg
from wsi_pipeline.cli._common import CommandParser, apply_output_level
from wsi_pipeline import interrupt
from wsi_pipeline.failures import ConfigTypeError
from wsi_pipeline.io_atomic import os_error_cause

__all__ = ["USER_ERRORS", "build_parser", "describe_error", "main"]

#: What a user can cause and fix: bad values and files (ValueError; ConfigTypeError: a config value of the
#: wrong type), missing files, a missing optional dependency, a lock not released in time, and every OSError
#: (no space left, read-only or not a folder, permissions), reported by :func:`describe_error`. Any other
#: ``TypeError``, ``AttributeError``, ``KeyError``, ... is a bug in our code: it propagates with its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, ConfigTypeError, ImportError, TimeoutError, OSError)

#: Longest error line printed (a value quoted in full could be megabytes).
MAX_ERROR_CHARS = 2000

_OS_ADVICE = {
    errno.ENOSPC: "the disk is full: free space or choose another output folder, then run the same command again",
    errno.EDQUOT: "the disk quota is used up: free space or choose another output folder",
    errno.EROFS: "the file system is read-only: choose a writable output folder",
    errno.EACCES: "permission denied: choose a folder you can write to",
    errno.EPERM: "permission denied: choose a folder you can write to",
    errno.ENOTDIR: "a path on the way is a file, not a folder: choose another output path",
    errno.EISDIR: "the path is a folder where a file was expected",
    errno.ELOOP: "too many levels of symbolic links (a link loop)",
}


#: A full disk, a used-up quota, a read-only file system: reported as one line however a library wrapped them.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def describe_error(err: BaseException) -> str:
    """One line for a user error: the message, and for an ``OSError`` the path, the reason and what to do."""
    if isinstance(err, OSError) and not isinstance(err, FileNotFoundError) and err.errno in _OS_ADVICE:
        where = f" {err.filename}" if err.filename else ""
        if err.filename2:
            where += f" -> {err.filename2}"
        text = f"{err.strerror or err}:{where} ({_OS_ADVICE[err.errno]})"
    else:
        text = str(err) or type(err).__name__
    text = " ".join(text.split())  # one line
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + f"... ({len(text)} characters)"

#: Commands in the order of the flow, then the side tools; ``--help`` lists them so (any other after).
FLOW = ("manifest", "tile", "train", "eval", "predict", "features", "weights", "verify", "tissue", "view", "demo")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with one subparser per command module."""
    parser = CommandParser(
        prog="wsi-pipeline",
        description=(
            "Whole-slide images to tile stores, end-to-end MIL models, evaluation and heatmaps. "
            "Run `wsi-pipeline <command> --help` for each command's options."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {wsi_pipeline.__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    names = [m.name for m in pkgutil.iter_modules(_cli_pkg.__path__) if not m.name.startswith("_") and m.name != "main"]
    # the flow first (manifest, tile, train, eval, predict), then features, tissue, demo, then any other
    for name in sorted(names, key=lambda n: (FLOW.index(n) if n in FLOW else len(FLOW), n)):
        module = importlib.import_module(f"{_cli_pkg.__name__}.{name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; return its exit status."""
    from wsi_pipeline.models.offline import go_offline

    go_offline()  # no command reaches the network: the model hubs' libraries are told so before any import
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # progress lines reach a log file even at the default level; --quiet: warnings and errors only
    levels = apply_output_level(args)
    restore_sigint = interrupt.install()  # a Ctrl-C swallowed by a finalizer still stops the next unit of work
    trusting = bool(getattr(args, "trust_unverified", False))
    if trusting:
        from wsi_pipeline.checkpoints.files import trust_unverified

        trust_unverified(True)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        if args.verbose >= 2:
            logging.getLogger(__name__).exception("traceback of the error below (-vv)")
        print(f"wsi-pipeline {args.command}: error: {describe_error(err)}", file=sys.stderr)
        return 2
    except Exception as err:
        # a library's own error over a file-system one (torch's zip writer over a full disk): the latter, one line
        cause = os_error_cause(err)
        if cause is None or cause.errno not in _DISK_ERRNOS:
            raise
        if args.verbose >= 2:
            logging.getLogger(__name__).exception("traceback of the error below (-vv)")
        print(f"wsi-pipeline {args.command}: error: {describe_error(cause)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # finished work is kept by every stage (atomic writes, completion markers, last.pt)
        print(f"\nwsi-pipeline {args.command}: interrupted; finished work is kept. Run the same command again to "
              "continue where it stopped.", file=sys.stderr)
        return 130
    finally:
        if trusting:
            trust_unverified(False)
        restore_sigint()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
