"""Configs: the pipeline YAML schema, its builder, overrides, I/O and the choice lists.

Modules (lowest first):

- ``schema``: the generic builder, YAML mapping -> frozen dataclass; errors name the field path.
- ``choices``: every choice list (``SCHEDULES``, ``BN_MODES``, ``SELECT_METRICS``,
  ``DEVICES``, ``TILING_METHODS``, ...; registries' names as functions), as ``Literal`` and tuple.
- ``strategy_traits``: what each training strategy does (``strategy_traits(name).trains_encoder``, ...), asked
  instead of comparing a strategy's name (the strategies themselves register in ``training.strategies``).
- ``overrides``: the one ``--set section.key=value`` syntax; ``io``: YAML read, atomic write, to plain dicts.
- tiling: ``tiling_params`` (each tissue detector's parameters, registered by name in ``DETECTOR_PARAMS``,
  and tile QC's), ``store_settings`` (``StoreSettings``: the one shape of tiling settings, what a store records
  and ``data.tiling``, versioned, with its migrations), ``tiling`` (the tiler's ``TilingConfig``, ``tiler_config``).
- sections: ``data``, ``train``, ``evaluation`` (``eval`` and the one ``EvalProtocol``),
  ``model`` (``encoder``, ``aggregator``, ``bigl``), ``patchgd`` (+ ``patchgd_presets``).
- ``pipeline``: ``PipelineConfig`` / ``MethodConfig``, ``load_config``, ``save_config``; re-exports the sections.
"""
