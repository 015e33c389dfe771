"""The ``wsi-pipeline`` console script.

Every module in :mod:`wsi_pipeline.cli` that defines ``register(subparsers)`` contributes one
subcommand; ``register`` adds a parser and sets ``func`` (``Callable[[argparse.Namespace], int]``)
as its default. Heavy imports (torch, openslide) happen inside ``func``, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

import wsi_pipeline
from wsi_pipeline import cli as _cli_pkg
from wsi_pipeline.cli._common import CommandParser, apply_output_level
from wsi_pipeline import interrupt

__all__ = ["build_parser", "main"]

#: Commands in the order of the flow, then the side tools; ``--help`` lists them so (any other after).
FLOW = ("manifest", "tile", "train", "eval", "predict", "features", "tissue", "demo")


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
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # finished work is kept by every stage (atomic writes, completion markers, last.pt)
        print(f"\nwsi-pipeline {args.command}: interrupted; finished work is kept. Run the same command again to "
              "continue where it stopped.", file=sys.stderr)
        return 130
    finally:
        restore_sigint()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
