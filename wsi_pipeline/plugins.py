"""Users' own components, found through the Python entry-point group ``wsi_pipeline.plugins``.

A package that adds an encoder, aggregator, task, strategy or tissue detector declares, in its
``pyproject.toml``::

    [project.entry-points."wsi_pipeline.plugins"]
    my_lab = "my_lab.wsi_parts"          # a module: importing it registers its parts
    # or "my_lab.wsi_parts:register"     # a function: called once, with no arguments

and registers its parts in that module (or function) with the same decorators the built-in parts
use (``@register_task``, ``AGGREGATORS.register``, ``ENCODERS.register``, ...; ``docs/extending.md``).
Once the package is installed (``pip install -e .``), every command of every process finds them:
the registries load the plugins the first time a name is looked up or listed (:func:`load_plugins`),
so tiling workers, Dask workers and ``torchrun`` ranks, which start as fresh interpreters, find
them too. A plugin that fails to import stops the command with an ``ImportError`` naming the entry
point and its package.
"""

from __future__ import annotations

import logging
from importlib import metadata
from types import ModuleType

__all__ = ["ENTRY_POINT_GROUP", "load_plugins", "loaded_plugins"]

log = logging.getLogger(__name__)

#: The entry-point group the plugins are declared in.
ENTRY_POINT_GROUP = "wsi_pipeline.plugins"

#: ``entry point name -> its value`` of every plugin loaded in this process; None until the first load.
_LOADED: dict[str, str] | None = None


def loaded_plugins() -> dict[str, str]:
    """The plugins loaded so far in this process (entry point name -> ``module`` or ``module:function``)."""
    return dict(_LOADED or {})


def load_plugins(*, reload: bool = False) -> dict[str, str]:
    """Import every ``wsi_pipeline.plugins`` entry point once per process (again with ``reload``).

    A module entry point is imported (its registrations run on import); an entry point naming a
    callable is called with no arguments. Returns the loaded plugins (name -> value). An entry point
    that cannot be loaded raises ``ImportError`` naming it, its value and its distribution.
    """
    global _LOADED
    if _LOADED is not None and not reload:
        return dict(_LOADED)
    _LOADED = {}  # set first: a plugin that looks a registry up while it loads does not load the plugins again
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in _LOADED:
            continue
        dist = getattr(ep.dist, "name", None) or "an installed package"
        try:
            obj = ep.load()
            if not isinstance(obj, ModuleType) and callable(obj):
                obj()
        except Exception as e:
            raise ImportError(f"plugin {ep.name!r} = {ep.value!r} (entry point group {ENTRY_POINT_GROUP!r}, "
                              f"from {dist}) failed to load: {type(e).__name__}: {e}") from e
        _LOADED[ep.name] = ep.value
        log.debug("plugin %s loaded (%s, from %s)", ep.name, ep.value, dist)
    return dict(_LOADED)
