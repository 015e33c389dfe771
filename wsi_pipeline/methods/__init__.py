"""Models from a method's config: the encoder (plain, Big-Layers, LoRA), the aggregator or PatchGD head,
and what the model predicts (its task's :class:`~wsi_pipeline.tasks.Endpoint`).

- :mod:`wsi_pipeline.methods.models`: :func:`build_models`, encoder state for a checkpoint and back;
- :mod:`wsi_pipeline.methods.endpoints`: a method's endpoint (output size, loss) from its config.

Shared by training (which trains them), the checkpoints (which store them) and inference (which scores with them).
"""
