"""Whole-image tissue segmentation after the shared-memory paper (``003`` in ``shared/papers``).

``labels`` (the paper's classical label pipeline), ``model`` (the 7-layer large-kernel U-Net),
``chunked`` (host-offloaded, chunked whole-image execution with exact gradients), ``stage``
(training and prediction over folders of slides).
"""
