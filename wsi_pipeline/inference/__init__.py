"""Scoring slides with a trained model: what training's validation and the eval and predict stages share.

- :mod:`wsi_pipeline.inference.trained`: a trained method loaded from its run folder (:func:`load_trained_model`);
- :mod:`wsi_pipeline.inference.protocols`: the evaluation protocols (all tiles, ``sub<k>x<R>``, ``ens<k>x<R>``),
  embedding a slide once and scoring it under each;
- :mod:`wsi_pipeline.inference.protocol_metrics`: validation metrics of a model under a protocol;
- :mod:`wsi_pipeline.inference.features`: frozen-encoder features of tile stores (``wsi-pipeline features``).

Owners elsewhere: models from a method's config in :mod:`wsi_pipeline.methods`, checkpoints in
:mod:`wsi_pipeline.checkpoints`, each task's losses and metrics in :mod:`wsi_pipeline.tasks`.
"""
