"""Big-Layers: exact training of CNN layers whose activations do not fit in device memory.

Activations of the big (early) layers live in host memory; each convolution and BatchNorm
moves sub-tensors (batch and row chunks with halo rows) to the compute device, computes, and
moves results back, within a budget of ``max_elements`` elements per chunk step. BatchNorm
statistics are exact over the whole input (two passes, Welford merge). :func:`bigify` converts
the stem and the first residual stages of our ResNets; after them the tensor moves to the
device for the rest of the network. Under autocast the layers follow plain autocast's precision
policy (:mod:`wsi_pipeline.bigl.precision`). For inference, :class:`EmbeddingEncoder` runs the
plain encoder on the device when a call's activations fit a budget, Big-Layers otherwise.

With a device budget (``bigify(..., device_budget_gb=...)``, :mod:`wsi_pipeline.bigl.budget`) a
step is plain when it fits; otherwise the early units (the stem, residual blocks) run as fused
runs (:mod:`wsi_pipeline.bigl.fused`): chunk by chunk on the device with halos, recomputed in
the backward pass, only their input and output existing whole, on the device when they fit and
in reused host buffers when not.
"""

from wsi_pipeline.bigl.batchnorm import BigBatchNorm2d
from wsi_pipeline.bigl.budget import StepPlan, plan_step
from wsi_pipeline.bigl.conv import BigConv2d
from wsi_pipeline.bigl.convert import BigResNet, bigify
from wsi_pipeline.bigl.embed import EmbeddingEncoder, inference_activation_bytes
from wsi_pipeline.bigl.instrument import TransferEvent, TransferMonitor, monitor_transfers, register_transfer_hook
from wsi_pipeline.bigl.planned import BudgetResNet
from wsi_pipeline.bigl.pointwise import BigAddReLU, BigMaxPool2d, BigReLU
from wsi_pipeline.bigl.chunk_loop import ChunkRunner

__all__ = [
    "bigify",
    "BigResNet",
    "BudgetResNet",
    "StepPlan",
    "plan_step",
    "EmbeddingEncoder",
    "inference_activation_bytes",
    "BigConv2d",
    "BigBatchNorm2d",
    "BigReLU",
    "BigMaxPool2d",
    "BigAddReLU",
    "ChunkRunner",
    "TransferEvent",
    "TransferMonitor",
    "monitor_transfers",
    "register_transfer_hook",
]
