"""What every command shares: the help formatter, ``--quiet``/``--no-progress``, ``--set``, ``--device``.

Each flag is defined once here, so it reads and behaves the same in every command. Nothing here
imports torch or a slide library: building the parser (``--help``) stays fast; registries that need
them are read by :class:`LazyChoices` only when a value is checked or a command's help is shown.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import re
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from wsi_pipeline.devices import DEVICES, check_device
from wsi_pipeline.failures import reworded

if TYPE_CHECKING:
    from wsi_pipeline.config.pipeline import PipelineConfig

T = TypeVar("T")

__all__ = [
    "CommandParser",
    "HelpFormatter",
    "LazyChoices",
    "add_device_argument",
    "add_failure_argument",
    "add_output_arguments",
    "add_set_argument",
    "apply_output_level",
    "add_config_flag",
    "config_flags",
    "config_from_args",
    "flag_values",
    "name_the_flag",
    "pipeline_from_args",
    "section_keys",
    "failure_status",
    "override",
]

_SAYS_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help only when it has a default worth showing.

    Not shown: no default (None), a flag's (``store_true``: False), an empty list (repeatable
    options), and any help text that already says its default in words.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is argparse.SUPPRESS
            or action.nargs == 0  # flags: store_true/false, count, help, version
            or (isinstance(default, (list, tuple)) and not default)
            or _SAYS_DEFAULT.search(text)
        ):
            return action.help
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with :class:`HelpFormatter`; its subcommands' parsers get both."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


class LazyChoices(Sequence[str]):
    """The names of a registry (``.names()``) or tuple, read from ``module.attr`` on first use."""

    def __init__(self, module: str, attr: str) -> None:
        self.module, self.attr = module, attr
        self._names: tuple[str, ...] | None = None
        self._obj: Any = None

    def _load(self) -> tuple[str, ...]:
        if self._names is None:
            self._obj = getattr(importlib.import_module(self.module), self.attr)
            self._names = tuple(self._obj.names() if hasattr(self._obj, "names") else self._obj)
        return self._names

    def __getitem__(self, i: Any) -> Any:
        return self._load()[i]

    def __len__(self) -> int:
        return len(self._load())

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __contains__(self, value: object) -> bool:
        self._load()
        return value in self._obj  # the object decides: a registry, a tuple, or a pattern (`timm:<architecture>`)

    def __repr__(self) -> str:
        return f"LazyChoices({self.module}.{self.attr})"


# ------------------------------------------------------------------------------------------------
# --quiet and --no-progress
# ------------------------------------------------------------------------------------------------

NO_PROGRESS_HELP = "no progress bars, and no periodic progress lines in logs"
QUIET_HELP = ("--no-progress, and no per-epoch or per-slide info lines: only warnings, errors and the final "
              "summary are printed")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--quiet`` and ``--no-progress`` (every long-running command has both, same meaning)."""
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def add_failure_argument(p: argparse.ArgumentParser, what: str = "slide") -> None:
    """Add ``--allow-failures``: exit 0 even when some {what}s failed (the default exit status is 1 then)."""
    p.add_argument("--allow-failures", action="store_true",
                   help=f"exit with status 0 even when some {what}s failed (they are still named in the summary and "
                        f"the report); without it the exit status is 1 when any {what} failed, so scripts and cluster "
                        "jobs notice")


def add_trust_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--trust-unverified``: load a checkpoint that neither its own digest nor a ``.sha256`` beside it can verify."""
    p.add_argument("--trust-unverified", action="store_true",
                   help="load a checkpoint that cannot be verified (saved by an older version: no digest inside it, no "
                        ".sha256 file beside it) instead of refusing it; a checkpoint whose digest does not match is "
                        "refused whatever this says")


def failure_status(failed: bool, args: argparse.Namespace) -> int:
    """The exit status of a command that ran to its end: 1 when something ``failed`` (unless
    ``--allow-failures``), else 0."""
    return 1 if failed and not getattr(args, "allow_failures", False) else 0


#: Loggers whose INFO lines are progress a log file should get even at the default level: the plain
#: progress lines written instead of bars when output is not a terminal, and per-epoch training lines.
PROGRESS_LOGGERS = ("wsi_pipeline.progress", "wsi_pipeline.training.loop")


def apply_output_level(args: argparse.Namespace) -> dict[str, int]:
    """Set our loggers' levels for ``args`` (``--quiet`` also sets ``args.no_progress``); return the old levels.

    Without ``--quiet``, :data:`PROGRESS_LOGGERS` log INFO; with it, the whole package logs
    warnings and errors only. The caller restores the returned levels when the command ends.
    """
    names = ("wsi_pipeline", *PROGRESS_LOGGERS)
    old = {name: logging.getLogger(name).level for name in names}
    if getattr(args, "quiet", False):
        args.no_progress = True
        for name in names:
            logging.getLogger(name).setLevel(logging.WARNING)
    else:
        for name in PROGRESS_LOGGERS:
            if logging.getLogger(name).getEffectiveLevel() > logging.INFO:
                logging.getLogger(name).setLevel(logging.INFO)
    return old


# ------------------------------------------------------------------------------------------------
# --set section.key=value
# ------------------------------------------------------------------------------------------------


def add_set_argument(p: argparse.ArgumentParser, sections: Callable[[], Mapping[str, tuple[str, ...]]] | None = None,
                     example: str = "train.epochs=2") -> None:
    """Add ``--set SECTION.KEY=VALUE`` (repeatable; into ``args.overrides``, read by :func:`config_from_args`).

    ``sections`` lists the sections (and their keys) a short ``key=value`` may belong to (default:
    the pipeline config's, :func:`_sections`); ``example`` is shown in the help.
    """
    p.add_argument(
        "--set", dest="overrides", action="append", type=_Override(sections), default=[], metavar="SECTION.KEY=VALUE",
        help=f"override a value of the config (repeatable), e.g. --set {example}"
             + (" --set methods.abmil_e2e.chunk_size=32 (in `methods`, a method's name or index)" if sections is None else "")
             + "; VALUE is read as YAML. A key that only one section has may omit the section"
             + (" (epochs=2 is train.epochs=2)" if sections is None else ""),
    )


def section_keys(cls: type) -> dict[str, tuple[str, ...]]:
    """``{name: keys}`` of the fields of dataclass ``cls``: a section's own keys when it is a dataclass, else ``()``."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        out[f.name] = tuple(g.name for g in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else ()
    return out


def _sections() -> dict[str, tuple[str, ...]]:
    """Top-level keys of a pipeline config, each with its keys when it is a section (a dataclass)."""
    from wsi_pipeline.config.pipeline import PipelineConfig

    return section_keys(PipelineConfig)


class _Override:
    """The argparse ``type=`` of ``--set``: :func:`override` against the sections a command reads."""

    def __init__(self, sections: Callable[[], Mapping[str, tuple[str, ...]]] | None) -> None:
        self.sections = sections
        self.__name__ = "override"  # argparse names the type in its messages

    def __call__(self, text: str) -> str:
        return override(text, self.sections() if self.sections is not None else None)


def override(text: str, sections: Mapping[str, tuple[str, ...]] | None = None) -> str:
    """One ``--set`` value in the ``section.key=value`` form of :func:`wsi_pipeline.config.overrides.apply_overrides`.

    The short form ``key=value`` is rewritten to ``section.key=value`` when exactly one section of
    ``sections`` (default: the pipeline config's) has ``key``; otherwise a usage error names the full form.
    """
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SECTION.KEY=VALUE, e.g. train.epochs=2")
    key, value = text.split("=", 1)
    key = key.strip()
    if "." in key:
        return text
    if sections is None:
        sections = _sections()
    if key in sections:
        return text
    owners = [s for s, keys in sections.items() if key in keys]
    if len(owners) == 1:
        return f"{owners[0]}.{key}={value}"
    if owners:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {key!r} is in several sections; write one of {', '.join(f'{s}.{key}={value}' for s in owners)}")
    raise argparse.ArgumentTypeError(
        f"{text!r}: no section has a key {key!r}; write SECTION.KEY=VALUE with a section of "
        f"{', '.join(s for s, keys in sections.items() if keys or s == 'methods')}, e.g. "
        f"{next((f'{s}.{keys[0]}=...' for s, keys in sections.items() if keys), 'train.epochs=2')}")


# ------------------------------------------------------------------------------------------------
# --config FILE: the one builder of every stage's settings
# ------------------------------------------------------------------------------------------------


def add_config_flag(p: argparse.ArgumentParser, *names: str, key: str, **kwargs: Any) -> argparse.Action:
    """Add a flag that sets the config value at key path ``key`` (``--bootstrap`` sets ``eval.bootstrap``).

    The flag's default is None (``store_true`` / ``store_false`` flags too), so a flag left out leaves
    the config's value; :func:`config_from_args` sets the given ones before ``--set``, and names the
    flag in an error about its value. Returns the argparse action.
    """
    kwargs.setdefault("default", None)
    action = p.add_argument(*names, **kwargs)
    flags = dict(p.get_default("config_flags") or {})
    flags[action.dest] = (action.option_strings[0], key)
    p.set_defaults(config_flags=flags)
    return action


def config_flags(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """``{dest: (flag, key path)}`` of the command's :func:`add_config_flag` flags."""
    return dict(getattr(args, "config_flags", None) or {})


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """``{key path: value}`` of the command's :func:`add_config_flag` flags that were given (not None)."""
    out: dict[str, Any] = {}
    for dest, (_, key) in config_flags(args).items():
        value = getattr(args, dest, None)
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out


def name_the_flag(e: Exception, args: argparse.Namespace) -> Exception:
    """``e`` with the flag named when its message is about a value a flag set (``eval.bootstrap=-1`` ->
    ``... (given as --bootstrap)``); ``e`` itself otherwise."""
    text = str(e)
    for dest, (flag, key) in config_flags(args).items():
        if getattr(args, dest, None) is not None and re.search(rf"{re.escape(key)}(?![\w.])", text):
            return reworded(e, f"{text} (given as {flag})")
    return e


def config_from_args(args: argparse.Namespace, make: Callable[[dict[str, Any]], T], *, what: str = "config") -> T:
    """A command's typed settings, the same way in every command: ``--config FILE`` (or none), the flags
    added with :func:`add_config_flag`, then ``--set``, then ``make`` (which builds and checks the
    dataclass): :func:`wsi_pipeline.config.overrides.build_config`.

    ``tile`` may call it with ``make=lambda raw: <its settings built from section_of(raw, "data.tiling")>``
    and its flags added by :func:`add_config_flag` with ``key="data.tiling.<name>"``.
    """
    from wsi_pipeline.config.overrides import build_config

    try:
        return build_config(getattr(args, "config", None), make, values=flag_values(args),
                            overrides=getattr(args, "overrides", ()) or (), what=what)
    except (ValueError, TypeError) as e:
        named = name_the_flag(e, args)
        if named is e:
            raise
        raise named from e


def pipeline_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The pipeline config of ``train`` / ``eval``: :func:`config_from_args` with the whole YAML checked as a
    :class:`~wsi_pipeline.config.pipeline.PipelineConfig` (:func:`~wsi_pipeline.config.pipeline.load_config`;
    ``name`` defaults to the file's stem)."""
    from wsi_pipeline.config import pipeline

    if getattr(args, "config", None) is None:
        raise ValueError("give the pipeline config: --config PIPELINE.yaml")
    try:
        return pipeline.load_config(args.config, getattr(args, "overrides", ()) or (), values=flag_values(args))
    except (ValueError, TypeError) as e:
        named = name_the_flag(e, args)
        if named is e:
            raise
        raise named from e


# ------------------------------------------------------------------------------------------------
# --device
# ------------------------------------------------------------------------------------------------

DEVICE_HELP = (f"compute device: {', '.join(DEVICES)} or cuda:<index>, as train.device in a pipeline YAML "
               "(auto: CUDA when present, else Apple MPS, else the CPU)")


def _device(text: str) -> str:
    try:
        return check_device(text, "--device")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_device_argument(p: argparse.ArgumentParser, default: str | None = "auto", note: str = "", key: str | None = None) -> None:
    """Add ``--device`` with the names of :data:`wsi_pipeline.devices.DEVICES` (``note`` ends its help); with
    ``key``, a flag that sets that config value (:func:`add_config_flag`; checked by the config)."""
    if key is not None:
        add_config_flag(p, "--device", key=key, metavar="DEVICE", help=DEVICE_HELP + f"; {key}" + (f" ({note})" if note else ""))
        return
    p.add_argument("--device", type=_device, default=default, metavar="DEVICE",
                   help=DEVICE_HELP + (f"; {note}" if note else ""))


# ------------------------------------------------------------------------------------------------
# --heatmap-mode (eval, predict)
# ------------------------------------------------------------------------------------------------


def add_heatmap_mode_argument(p: argparse.ArgumentParser, section: str) -> None:
    """Add ``--heatmap-mode``, which sets ``<section>.heatmap_mode`` (the config checks it; the modes of
    :data:`wsi_pipeline.config.choices.HEATMAP_MODES` are listed in ``--help``)."""
    add_config_flag(p, "--heatmap-mode", key=f"{section}.heatmap_mode",
                    choices=LazyChoices("wsi_pipeline.config.choices", "HEATMAP_MODES"), metavar="MODE",
                   help="colour normalisation of the heatmaps, one of %(choices)s: per-slide rank (the default), "
                        f"per-slide min-max, or the raw scores ({section}.heatmap_mode)")
