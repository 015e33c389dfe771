"""YAML in and out: reading a config file, config dataclasses -> plain containers, atomic saving.

Every YAML text the package reads (config files, ``--set`` values, ``--cluster-option`` values)
goes through :func:`load_yaml`: ``yaml.safe_load``'s constructors, bounded. A document larger
than :data:`MAX_YAML_BYTES` or with more than :data:`MAX_YAML_ALIASES` aliases is refused before
it is built, as is one that would hold more than :data:`MAX_YAML_VALUES` values once its aliases are
expanded (an alias bomb of a few hundred bytes otherwise expands to gigabytes), and a mapping
with a key twice is refused with both lines (YAML 1.2 forbids it; PyYAML keeps the last silently).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from wsi_pipeline.io_atomic import write_text_atomic
from wsi_pipeline.failures import ConfigTypeError

__all__ = ["MAX_YAML_ALIASES", "MAX_YAML_BYTES", "config_to_dict", "load_yaml", "read_yaml", "short_repr", "write_yaml"]

#: Largest YAML text read, in bytes (a pipeline config is a few kB).
MAX_YAML_BYTES = 1 << 20
#: Most aliases (``*name``) one YAML text may use.
MAX_YAML_ALIASES = 100
#: Most values a YAML text may hold once its aliases are expanded (a pipeline config: a few hundred).
MAX_YAML_VALUES = 100_000


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (with a note of the full length), for error messages."""
    text = reprlib_repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def reprlib_repr(value: Any) -> str:
    """A repr that never builds a huge string: long containers and strings are shortened first."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = 200
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 12
    r.maxlevel = 4
    return r.repr(value)


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts aliases and refuses duplicate keys."""

    def __init__(self, stream: str, source: str) -> None:
        super().__init__(stream)
        self.source = source
        self.aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                mark = self.peek_event().start_mark
                raise ValueError(
                    f"{self.source}: more than {MAX_YAML_ALIASES} YAML aliases (*name), at line {mark.line + 1}; "
                    "refused (a config needs few or none; many expand into a huge document)"
                )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                line = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if line is not None:
                raise ValueError(
                    f"{self.source}: duplicate key {key!r} at line {key_node.start_mark.line + 1} "
                    f"(first at line {line}); each key may appear once in a mapping"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: Any) -> int:
    """Number of values under the composed YAML node ``root`` with every alias expanded (shared nodes
    counted once per use), computed once per distinct node."""
    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1
            continue
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else list(node.value)
        if done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def load_yaml(text: str, source: str = "<yaml>") -> Any:
    """Parse one YAML document like ``yaml.safe_load``, within bounds.

    Raises ``ValueError`` naming ``source`` for: text longer than :data:`MAX_YAML_BYTES` bytes,
    more than :data:`MAX_YAML_ALIASES` aliases, a duplicate key (with both lines), invalid YAML.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{source}: {size} bytes, larger than the {MAX_YAML_BYTES} bytes a YAML config may have")
    loader = _BoundedLoader(text, source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = _expanded_size(node)
        if n > MAX_YAML_VALUES:
            raise ValueError(
                f"{source}: its {loader.aliases} YAML aliases (*name) expand it to {n} values, more than the "
                f"{MAX_YAML_VALUES} a config may hold; refused (an 'alias bomb')"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ValueError(f"{source}: not valid YAML: {str(e)[:500]}") from e
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike, what: str = "pipeline config") -> dict[str, Any]:
    """The mapping in YAML file ``path`` (:func:`load_yaml`; an empty file is ``{}``).

    Raises ``FileNotFoundError`` (no such file), ``ValueError`` (not valid YAML, or beyond
    :func:`load_yaml`'s bounds) or ``TypeError`` (not a mapping), each naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}; configs live in pipelines/*.yaml")
    if path.stat().st_size > MAX_YAML_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, larger than the {MAX_YAML_BYTES} bytes a YAML config may have")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line}); save the {what} "
                         "as UTF-8") from None
    raw = load_yaml(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigTypeError(f"{path}: a {what} must be a mapping of sections; got {type(raw).__name__}")
    return raw


def _to_raw(obj: Any) -> Any:
    if hasattr(obj, "to_raw"):
        return obj.to_raw()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_raw(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_raw(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): _to_raw(v) for k, v in obj.items()}
    return obj


def config_to_dict(config: Any) -> Any:
    """Plain YAML-able containers (dict/list/str/int/float/bool/None) for any config dataclass.

    A value with a ``to_raw()`` method (a protocol) is written in its YAML form;
    ``config_from_dict(config_to_dict(c)) == c`` for a pipeline config.
    """
    return _to_raw(config)


def write_yaml(config: Any, path: str | os.PathLike) -> Path:
    """Write ``config`` (a config dataclass or plain containers) as YAML, atomically; return ``path``."""
    return write_text_atomic(path, yaml.safe_dump(config_to_dict(config), sort_keys=False))
