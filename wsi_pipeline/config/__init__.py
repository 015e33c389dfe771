"""Configs: the pipeline YAML schema, its builder, overrides, I/O and the choice lists.

Modules (lowest first):

- ``schema``: the generic builder, YAML mapping -> frozen dataclass; errors name the field path.
- ``choices``: every choice list (``SCHEDULES``, ``BN_MODES``, ``SELECT_METRICS``, ``STRATEGY_NAMES``,
  ``DEVICES``, ``TILING_METHODS``, ...; registries' names as functions), as ``Literal`` and tuple.
- ``overrides``: the one ``--set section.key=value`` syntax; ``io``: YAML read, atomic write, to plain dicts.
- sections: ``tiling`` (the tiler's ``TilingConfig``, ``OtsuParams``, ``data.tiling`` as ``StoreTiling``,
  ``tiler_config``), ``data``, ``train``, ``evaluation`` (``eval`` and the one ``EvalProtocol``),
  ``model`` (``encoder``, ``aggregator``, ``bigl``), ``patchgd`` (+ ``patchgd_presets``).
- ``pipeline``: ``PipelineConfig`` / ``MethodConfig``, ``load_config``, ``save_config``; re-exports the sections.
"""
