"""A traced step at any micro-batch from two traces: every size of a training step is affine in the batch.

Why: a search proposes many micro-batches of one model; tracing each costs seconds (the ops run through
FakeTensorMode in Python). The ops, storages and saved tensors of a step are the same for every batch size
≥ 2 (fake tensors have no data-dependent control flow); only sizes change, and each is affine in b: a tensor
dimension is either the batch (or a multiple) or independent of it, so bytes, FLOPs and shapes follow
v(b) = v(b0) + (v(b1) - v(b0)) · (b - b0) / (b1 - b0). As `planner.perf.roofline` does for the analytic
kernel list, the trace is taken at two batch sizes and any other is interpolated (where many micro-batches of
one shape class are asked for, `planner.program.sources.many_batches`; one estimate traces its own batch).

Checked, not assumed: the two traces must have the same ops, events, saved tensors and blocks in the same
order, and every interpolated value must be a whole, non-negative number; otherwise `scaled` returns None and
the caller traces the batch itself. b0 = 2, not 1: code that special-cases one sample (padding only when
b > 1, squeezing a batch of one) would make b = 1 a different program. Allocator rounding (512 B) is applied
to saved bytes per tensor, so interpolated saved bytes can differ from a direct trace by < 512 B per saved
tensor; the caller re-rounds them.
"""

from __future__ import annotations

from dataclasses import replace

from planner.program import cuda
from planner.program.records import OpRecord, SavedRecord, StepTrace, StorageEvent, TensorMeta, block_memory

BASE_BATCHES = (2, 4)  # the two batch sizes traced (module docstring: why not 1)


class _Mismatch(Exception):
    """The two traces are not the same program at two sizes."""


def _lerp(a: int, b: int, t: float, strict: bool = True) -> int:
    """a + (b - a)·t; `strict`: it must be whole (tensor dimensions); else rounded (byte peaks measured over
    512-byte-rounded blocks, which are affine only up to that rounding)."""
    v = a + (b - a) * t
    r = round(v)
    if (strict and abs(v - r) > 1e-6) or r < 0:
        raise _Mismatch
    return int(r)


def _shape(a: tuple[int, ...], b: tuple[int, ...], t: float) -> tuple[int, ...]:
    if len(a) != len(b):
        raise _Mismatch
    return tuple(_lerp(x, y, t) for x, y in zip(a, b, strict=True))


def _metas(a: tuple[TensorMeta, ...], b: tuple[TensorMeta, ...], t: float) -> tuple[TensorMeta, ...]:
    if len(a) != len(b):
        raise _Mismatch
    return tuple(TensorMeta(_shape(x.shape, y.shape, t), x.dtype) if x.shape != y.shape else x
                 for x, y in zip(a, b, strict=True))


def _op(a: OpRecord, b: OpRecord, t: float, memo: dict) -> OpRecord:
    """`memo`: (a's metadata, b's) -> the interpolated metadata, for one t (a step repeats few distinct ones:
    interpolating each op's afresh was most of an interpolation's time)."""
    if (a.name, a.phase, a.module, a.kernel) != (b.name, b.phase, b.module, b.kernel):
        raise _Mismatch
    key = (a.inputs, b.inputs)
    inputs = memo.get(key)
    if inputs is None:
        inputs = memo[key] = _metas(a.inputs, b.inputs, t)
    key = (a.outputs, b.outputs)
    outputs = memo.get(key)
    if outputs is None:
        outputs = memo[key] = _metas(a.outputs, b.outputs, t)
    flops = _lerp(a.flops, b.flops, t) if a.flops != b.flops else a.flops
    if inputs == a.inputs and outputs == a.outputs and flops == a.flops:
        return a
    return OpRecord(a.index, a.name, a.phase, a.module, inputs, outputs, flops, a.kernel)


def _event(a: StorageEvent, b: StorageEvent, t: float) -> StorageEvent:
    if (a.op, a.action, a.storage, a.dtype, a.category) != (b.op, b.action, b.storage, b.dtype, b.category):
        raise _Mismatch
    return a if a.nbytes == b.nbytes else StorageEvent(a.op, a.action, a.storage, _lerp(a.nbytes, b.nbytes, t),
                                                       a.dtype, a.category)


def _saved(a: SavedRecord, b: SavedRecord, t: float, backend: str, device_nbytes: dict[int, int]) -> SavedRecord:
    if (a.storage, a.block, a.module, a.dtype, a.rule) != (b.storage, b.block, b.module, b.dtype, b.rule):
        raise _Mismatch
    # device bytes: the storage's unrounded size (its interpolated alloc event) is affine, the 512-byte
    # rounding is not, so round again
    unrounded = device_nbytes.get(a.storage)
    device = (cuda.allocation_bytes(unrounded, backend) if unrounded is not None
              else _lerp(a.device_bytes, b.device_bytes, t))
    return replace(a, shape=_shape(a.shape, b.shape, t), cpu_bytes=_lerp(a.cpu_bytes, b.cpu_bytes, t),
                   device_bytes=device)


def scaled(t0: StepTrace, t1: StepTrace, b0: int, b1: int, b: int) -> StepTrace | None:
    """The trace at micro-batch `b` interpolated from traces at `b0` and `b1`; None when they differ in
    anything but sizes (then trace `b` directly)."""
    t = (b - b0) / (b1 - b0)
    try:
        if (len(t0.ops), len(t0.events), len(t0.saved), len(t0.blocks)) != (
                len(t1.ops), len(t1.events), len(t1.saved), len(t1.blocks)):
            raise _Mismatch
        if (t0.parameters, t0.gradient_shapes, t0.buffer_bytes, t0.checkpointed) != (
                t1.parameters, t1.gradient_shapes, t1.buffer_bytes, t1.checkpointed):
            raise _Mismatch
        events = tuple(_event(x, y, t) for x, y in zip(t0.events, t1.events, strict=True))
        device_nbytes = {e.storage: e.nbytes for e in events if e.action == "alloc"}
        saved = tuple(_saved(x, y, t, t0.backend, device_nbytes) for x, y in zip(t0.saved, t1.saved, strict=True))
        if t0.op_blocks != t1.op_blocks:
            raise _Mismatch
        memo: dict = {}
        ops = tuple(_op(x, y, t, memo) for x, y in zip(t0.ops, t1.ops, strict=True))
        # per-block saved bytes and transient peaks: measured again over the interpolated events (a peak is a
        # max over ops of 512-byte-rounded sizes, affine only piecewise)
        if t0.retained_storages != t1.retained_storages:
            raise _Mismatch
        retained: dict[str, int] = {}
        for block, sid in t0.retained_storages:
            if sid not in device_nbytes:
                raise _Mismatch
            retained[block] = retained.get(block, 0) + cuda.allocation_bytes(device_nbytes[sid], t0.backend)
        forward_end = sum(op.phase == "forward" for op in ops)
        backward_end = forward_end + sum(op.phase == "backward" for op in ops)
        blocks = block_memory(events, t0.op_blocks, saved, t0.block_parameters, retained, forward_end,
                              backward_end, t0.backend,  # type: ignore[arg-type]
                              frozenset(sid for _, sid in t0.retained_storages))
        if [b.name for b in blocks] != [b.name for b in t0.blocks]:
            raise _Mismatch
        return replace(
            t0, batch_bytes=_lerp(t0.batch_bytes, t1.batch_bytes, t), blocks=blocks, saved=saved,
            ops=ops, events=events)
    except _Mismatch:
        return None
