"""The chunk loop shared by every Big-Layer: send chunk inputs, compute, send results back.

Host activations are channels-last (``[N, C, H, W]`` with NHWC memory), so a chunk of whole
samples, or of rows of one sample, is one contiguous block of host memory and one DMA.

On CUDA the host tensors the runner allocates are pinned (or, with ``pin_memory=False``,
pageable and staged through chunk-sized pinned buffers), and two side streams carry the
copies: while the compute stream works on chunk ``i``, the host-to-device stream already
moves chunk ``i + 1`` and the device-to-host stream returns chunk ``i - 1``'s results. Chunk
tensors are allocated by PyTorch's caching allocator and tagged with ``record_stream`` for
every stream that uses them, so their memory is reused only after those streams are done;
at most two chunks are in flight. Managed (unified) memory is never used. On the CPU the same
loop runs, with the streams and copies reduced to no-ops.

Precision: every ``compute`` runs with autocast switched off for the compute device; the layers
decide their precision themselves (:mod:`wsi_pipeline.bigl.precision`), once per call, so the
forward and the backward pass follow the same policy as plain autocast.

Device-resident tensors: a fused run (:mod:`wsi_pipeline.bigl.fused`) may keep its input or
output on the compute device when the device budget allows (:mod:`wsi_pipeline.bigl.budget`);
``run(..., resident_in=, resident_out=)`` marks such loads and destinations: they are used in
place (results copied on the device), never cross the bus and are not reported as transfers.

Host buffers reused across steps: :class:`HostBuffers` hands out named host tensors (pinned on
CUDA) and takes them back when a step no longer needs them, so the next step writes into the
same pinned memory instead of allocating and page-locking it again.

Dry runs: with ``device="meta"`` host and device tensors are both meta tensors (shapes only, no
memory, no arithmetic), so a training step of any size runs in seconds and the transfer
instrumentation reports exactly the chunks, elements and bytes a real run would move
(``make bench-bigl`` counts transfers this way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

from wsi_pipeline.bigl import instrument
from wsi_pipeline.bigl.plan import Chunk

__all__ = ["ChunkRunner", "HostBuffers"]

#: the chunk type of one pass (RowChunk for single layers, UnitChunk for fused runs)
C = TypeVar("C", bound=Chunk)
Load = Callable[[int, C], Sequence[torch.Tensor]]
Compute = Callable[[int, C, Sequence[torch.Tensor]], Sequence[torch.Tensor]]
Store = Callable[[int, C], Sequence[torch.Tensor]]


def _empty_host(shape: Sequence[int], dtype: torch.dtype, pinned: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    if len(shape) == 4:
        n, c, h, w = shape
        # a base tensor with channels-last strides (not a permuted view: autograd forbids
        # in-place ops on views returned by custom Functions)
        return torch.empty_strided((n, c, h, w), (h * w * c, 1, w * c, c), dtype=dtype, pin_memory=pinned, device=device)
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pinned, device=device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s memory (its storage object; meta tensors included, which have no address)."""
    return t.untyped_storage()._cdata


def _dense(t: torch.Tensor) -> bool:
    if t.dim() == 4:
        return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
    return t.is_contiguous()


class ChunkRunner:
    """Runs the chunk steps of Big-Layers on one compute device.

    Parameters
    ----------
    device
        The compute device (``cpu`` or ``cuda[:k]``). Host tensors live in CPU memory
        (:attr:`host_device`); ``meta`` makes a dry run (host tensors are meta tensors too).
    pin_memory
        CUDA only: allocate host activations in pinned memory, so every chunk copy is an async
        DMA straight from/to them. PyTorch's pinned allocator rounds each block up to a power of
        two; with ``False`` activations are pageable and each chunk passes through a
        chunk-sized pinned staging buffer (one extra host copy, still overlapped).
    """

    def __init__(self, device: torch.device | str, *, pin_memory: bool = True) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_cuda = self.device.type == "cuda"
        self.pin_memory = bool(pin_memory) and self.is_cuda
        #: where Big-Layer activations live: CPU memory, or nowhere (meta) in a dry run
        self.host_device = torch.device("meta") if self.device.type == "meta" else torch.device("cpu")
        if self.is_cuda:
            self._h2d = torch.cuda.Stream(self.device)
            self._d2h = torch.cuda.Stream(self.device)
        self._res_in: tuple[bool, ...] = ()
        self._res_out: tuple[bool, ...] = ()
        #: host tensors reused across steps (fused runs' checkpoints and their gradients)
        self.buffers = HostBuffers(self)

    def __repr__(self) -> str:
        return f"ChunkRunner(device={self.device})"

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype, *, zero: bool = False) -> torch.Tensor:
        """Host tensor for Big-Layer activations: channels-last for 4-D, pinned when ``pin_memory``."""
        t = _empty_host(shape, dtype, self.pin_memory, self.host_device)
        if zero:
            t.zero_()
        return t

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a channels-last host tensor (differentiable; no copy if it already is one)."""
        return x.to(self.host_device).contiguous(memory_format=torch.channels_last)

    def is_host(self, x: torch.Tensor) -> bool:
        """Whether ``x`` already lives where Big-Layer activations live."""
        return x.device == self.host_device

    def _no_autocast(self):
        """Autocast off for the compute device while a chunk computes (the layers cast explicitly)."""
        if self.device.type in ("cpu", "cuda"):
            return torch.autocast(self.device.type, enabled=False)
        return contextlib.nullcontext()

    def run(self, layer: str, chunks: Sequence[C], load: Load[C], compute: Compute[C], store: Store[C] | None = None, *,
            resident_in: Sequence[bool] = (), resident_out: Sequence[bool] = (),
            signature: Callable[[int, C], Hashable] | None = None) -> None:
        """Run every chunk step of one pass of one layer.

        Parameters
        ----------
        layer
            Name reported to the instrumentation hooks.
        chunks
            The plan, in order.
        load
            ``load(i, chunk)`` -> host tensors (views) to send to the device.
        compute
            ``compute(i, chunk, device_tensors)`` -> device tensors to send back (may be empty);
            runs on the current stream, in chunk order, so it may keep state across chunks.
        store
            ``store(i, chunk)`` -> host views receiving ``compute``'s results, same shapes.
        resident_in, resident_out
            Per loaded tensor / per destination: True when it already lives on the compute device
            (used in place, not transferred, not reported); missing entries are False.
        signature
            Dry runs (``meta``) only: ``signature(i, chunk)`` is equal for chunks whose loads,
            results and FLOPs have the same shapes; such a chunk is computed once per pass and
            replayed after (its transfers and FLOPs reported again, ``compute`` and ``store`` not
            called), so a dry run costs the distinct chunk shapes, not the chunks.
        """
        if not chunks:
            return
        watch = instrument.active()
        if watch:
            instrument.pass_start(layer)
        try:
            self._run(layer, chunks, load, compute, store, watch, signature, resident_in, resident_out)
        finally:
            if watch:
                instrument.pass_end(layer)

    def _run(self, layer: str, chunks: Sequence[C], load: Load[C], compute: Compute[C], store: Store[C] | None, watch: bool,
             signature: Callable[[int, C], Hashable] | None, resident_in: Sequence[bool], resident_out: Sequence[bool]) -> None:
        """The chunk steps of :meth:`run` (between its ``start`` and ``end`` events)."""
        self._res_in, self._res_out = tuple(resident_in), tuple(resident_out)
        if self.is_cuda:
            with torch.cuda.device(self.device):
                self._run_cuda(layer, chunks, load, compute, store, watch)
        else:
            replay = signature if self.device.type == "meta" else None
            seen: dict[Hashable, tuple[int, list[tuple[int, int]]]] = {}
            pending = self._send_cpu(layer, 0, chunks[0], load, watch)
            for i, ch in enumerate(chunks):
                ins = pending
                sig = replay(i, ch) if replay is not None else None
                if sig is not None and sig in seen:
                    pending = self._send_cpu(layer, i + 1, chunks[i + 1], load, watch) if i + 1 < len(chunks) else ()
                    self._replay(layer, i, ch, ins, seen[sig], watch)
                    del ins
                    continue
                f0 = instrument.flop_total()
                with self._no_autocast():
                    outs = compute(i, ch, ins)
                flops = instrument.flop_total() - f0
                pending = self._send_cpu(layer, i + 1, chunks[i + 1], load, watch) if i + 1 < len(chunks) else ()
                sent = [t for k, t in enumerate(ins) if not self._resident(self._res_in, k)]
                moved = sum(t.numel() for t in sent)
                moved_bytes = sum(_nbytes(t) for t in sent)
                if sig is not None:
                    seen[sig] = (flops, [(o.numel(), _nbytes(o)) for k, o in enumerate(outs) if not self._resident(self._res_out, k)])
                dests = store(i, ch) if store is not None else ()
                self._check(layer, dests, outs)
                for k, (d, o) in enumerate(zip(dests, outs)):
                    if o.numel():
                        d.copy_(o)
                    if self._resident(self._res_out, k):
                        continue
                    if watch:
                        instrument.track("d2h", layer, i, o)
                    moved += o.numel()
                    moved_bytes += _nbytes(o)
                if watch:
                    instrument.chunk_done(layer, i, moved, ch.samples, ch.o1 - ch.o0, ch.full, moved_bytes)
                del ins, outs, sent

    def _replay(self, layer: str, i: int, ch: Chunk, ins: Sequence[torch.Tensor], cached: tuple[int, list[tuple[int, int]]], watch: bool) -> None:
        """Report a dry-run chunk like an earlier one of the same shapes (its uploads were reported on loading)."""
        flops, outs = cached
        instrument.add_flops(flops)
        sent = [t for k, t in enumerate(ins) if not self._resident(self._res_in, k)]
        moved = sum(t.numel() for t in sent) + sum(n for n, _ in outs)
        moved_bytes = sum(_nbytes(t) for t in sent) + sum(b for _, b in outs)
        if watch:
            for n, b in outs:
                instrument.report("d2h", layer, i, n, b)
            instrument.chunk_done(layer, i, moved, ch.samples, ch.o1 - ch.o0, ch.full, moved_bytes)

    @staticmethod
    def _resident(flags: tuple[bool, ...], k: int) -> bool:
        return k < len(flags) and bool(flags[k])

    def _send_cpu(self, layer: str, i: int, ch: C, load: Load[C], watch: bool) -> tuple[torch.Tensor, ...]:
        ins = tuple(load(i, ch))
        if watch:
            for k, t in enumerate(ins):
                if not self._resident(self._res_in, k):
                    instrument.track("h2d", layer, i, t)
        return ins

    @staticmethod
    def _check(layer: str, dests: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        if len(dests) != len(outs) or any(d.shape != o.shape or d.dtype != o.dtype for d, o in zip(dests, outs)):
            raise RuntimeError(
                f"internal error in Big-Layer {layer}: results {[(tuple(o.shape), o.dtype) for o in outs]} "
                f"do not match destinations {[(tuple(d.shape), d.dtype) for d in dests]}"
            )

    # ---- CUDA: pinned buffers, copy streams, events -------------------------------------
    def _send_cuda(self, layer: str, i: int, ch: C, load: Load[C], watch: bool) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
        srcs = []
        loaded = tuple(load(i, ch))
        for k, t in enumerate(loaded):
            if self._resident(self._res_in, k):
                srcs.append(t)
                continue
            if not (t.is_pinned() and _dense(t)):
                # pageable or strided: stage through a pinned buffer so the copy is a real async DMA
                # (the pinned allocator keeps the buffer until the copy has completed)
                staged = _empty_host(t.shape, t.dtype, True)
                staged.copy_(t)
                t = staged
            srcs.append(t)
        ins = []
        with torch.cuda.stream(self._h2d):
            for k, t in enumerate(srcs):
                if self._resident(self._res_in, k):
                    ins.append(t)  # already on the device: used in place
                    continue
                d = torch.empty_like(t, device=self.device)
                d.copy_(t, non_blocking=True)
                ins.append(d)
            ready = torch.cuda.Event()
            ready.record(self._h2d)
        if watch:
            for k, d in enumerate(ins):
                if not self._resident(self._res_in, k):
                    instrument.track("h2d", layer, i, d)
        return tuple(ins), ready

    def _run_cuda(self, layer: str, chunks: Sequence[C], load: Load[C], compute: Compute[C], store: Store[C] | None,
                  watch: bool) -> None:
        cur = torch.cuda.current_stream(self.device)
        # results bound for pageable host memory: (event, pinned staging buffer, destination),
        # copied on the host once their DMA is done, while the device works on later chunks
        landing: list[tuple[int, torch.cuda.Event, torch.Tensor, torch.Tensor]] = []
        pending: tuple[tuple[torch.Tensor, ...], torch.cuda.Event] | None = self._send_cuda(layer, 0, chunks[0], load, watch)
        for i, ch in enumerate(chunks):
            if pending is None:
                raise RuntimeError(f"internal error in Big-Layer {layer}: chunk {i} of {len(chunks)} was never sent")
            ins, ready = pending
            cur.wait_event(ready)
            for t in ins:
                t.record_stream(cur)
            with self._no_autocast():
                outs = tuple(compute(i, ch, ins))
            # queue the next chunk's transfer while the device computes this one
            pending = self._send_cuda(layer, i + 1, chunks[i + 1], load, watch) if i + 1 < len(chunks) else None
            sent = [t for k, t in enumerate(ins) if not self._resident(self._res_in, k)]
            moved = sum(t.numel() for t in sent)
            moved_bytes = sum(_nbytes(t) for t in sent)
            dests = store(i, ch) if store is not None else ()
            self._check(layer, dests, outs)
            for k, (d, o) in enumerate(zip(dests, outs)):
                if self._resident(self._res_out, k) and o.numel():
                    d.copy_(o)  # device to device, on the compute stream
            if any(not self._resident(self._res_out, k) for k in range(len(outs))):
                # same memory layout as the host view, so each copy back is a single DMA
                outs = tuple(
                    o if d.stride() == o.stride() else o.contiguous(memory_format=torch.channels_last) if o.dim() == 4 else o.contiguous()
                    for d, o in zip(dests, outs)
                )
                done = torch.cuda.Event()
                done.record(cur)
                self._d2h.wait_event(done)
                with torch.cuda.stream(self._d2h):
                    for k, (d, o) in enumerate(zip(dests, outs)):
                        if o.numel() == 0 or self._resident(self._res_out, k):
                            continue
                        o.record_stream(self._d2h)
                        if d.is_pinned() and _dense(d):
                            d.copy_(o, non_blocking=True)
                        else:
                            staged = _empty_host(o.shape, o.dtype, True)
                            staged.copy_(o, non_blocking=True)
                            arrived = torch.cuda.Event()
                            arrived.record(self._d2h)
                            landing.append((i, arrived, staged, d))
                        moved += o.numel()
                        moved_bytes += _nbytes(o)
                        if watch:
                            instrument.track("d2h", layer, i, o)
            # land the previous chunks' results (their DMA ran while this chunk was computed)
            while landing and landing[0][0] < i:
                _, arrived, staged, d = landing.pop(0)
                arrived.synchronize()
                d.copy_(staged)
            if watch:
                instrument.chunk_done(layer, i, moved, ch.samples, ch.o1 - ch.o0, ch.full, moved_bytes)
            del ins, outs, sent
        # host code (autograd, the next layer's staging) reads the results right after; device
        # state of the pass (accumulated dW, statistics) stays ordered on `cur`
        self._d2h.synchronize()
        for _, _, staged, d in landing:
            d.copy_(staged)


class HostBuffers:
    """Named host tensors (channels-last for 4-D; pinned on CUDA) reused from one step to the next.

    :meth:`acquire` returns the tensor kept under ``key`` when it has the requested shape and
    dtype and is free, else allocates one (and keeps it under ``key`` for the next step when the
    slot is free); :meth:`release` makes it free again. A step acquires, say, ``layer1.0/out``
    in its forward pass and releases it when the backward pass has used it for the last time,
    so a training loop pins each buffer once. Released contents are garbage: callers write
    before they read. On CUDA a reused buffer is handed out only after the runner's copy
    streams are done with it.
    """

    def __init__(self, runner: ChunkRunner) -> None:
        self.runner = runner
        self._slots: dict[str, torch.Tensor] = {}
        self._busy: set[str] = set()

    def acquire(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` for ``key`` (contents undefined)."""
        t = self._slots.get(key)
        if key not in self._busy:
            if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                t = self._slots[key] = self.runner.host_empty(shape, dtype)
            elif self.runner.is_cuda:
                self.runner._h2d.synchronize()  # earlier uploads from it are done
                self.runner._d2h.synchronize()
            self._busy.add(key)
            return t
        return self.runner.host_empty(shape, dtype)  # the slot is still in use: an unpooled tensor

    def release(self, t: torch.Tensor | None) -> None:
        """Make the pooled buffer ``t`` shares memory with free again (anything else is ignored)."""
        if t is None:
            return
        key = _storage_key(t)
        for name, s in self._slots.items():
            if _storage_key(s) == key:
                self._busy.discard(name)
                return

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares memory with one of the pooled buffers."""
        key = _storage_key(t)
        return any(_storage_key(s) == key for s in self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)
