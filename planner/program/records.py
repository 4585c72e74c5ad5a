"""What a trace records, as plain data, and the per-block figures derived from it: no torch here.

Why a module of its own: a trace read back from the on-disk cache (`planner.program.trace_cache`) and the
interpreters that read a trace (`scale`, `replay`, `speed`) need these records but not PyTorch, whose import
alone costs more than a catalog model's whole estimate. `planner.program.trace` makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.program import cuda
from planner.spec import Backend

LOSS_BLOCK = "loss"
ROOT_BLOCK = "(model)"  # ops of the root module's own forward, outside any child


# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class OpRecord:
    """One ATen op of the step, in execution order (CPU op name; the kernel list for the roofline)."""

    index: int
    name: str  # e.g. "aten.mm.default"
    phase: str  # forward, backward or optimizer
    module: str  # qualified name of the module running ("" = the root / the loss)
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    flops: int = 0  # torch.utils.flop_counter's formula for the op (0 where it has none: memory-bound ops)
    kernel: bool = True  # False for ops that launch no CUDA kernel (views, empty, detach): `_NO_KERNEL`


@dataclass(frozen=True)
class StorageEvent:
    """A storage allocated or freed after op `op` (-1: before the step). `nbytes`: on the device, unrounded."""

    op: int
    action: str  # "alloc" or "free"
    storage: int
    nbytes: int
    dtype: str
    category: str  # parameter, buffer, batch, gradient, activation (saved), temporary, optimizer_state


@dataclass(frozen=True)
class SavedRecord:
    """One storage saved for backward by the forward (each storage once)."""

    storage: int
    block: str
    module: str
    shape: tuple[int, ...]
    dtype: str  # on the device
    cpu_bytes: int
    device_bytes: int  # allocator-rounded on CUDA
    rule: str  # the cuda.py rule that changed it, if any


@dataclass(frozen=True)
class TracedBlock:
    """One top-level child module (or the root's own ops, or the loss), in forward order."""

    name: str
    parameters: int
    saved_bytes: int  # what its forward saves for backward (allocator-rounded)
    forward_transient_bytes: int  # measured: peak unsaved temporaries while it runs
    backward_transient_bytes: int  # measured: peak temporaries (activation gradients) in its backward
    retained_bytes: int = 0  # model outputs it produced that the training loop keeps (logits)


@dataclass(frozen=True)
class StepTrace:
    name: str
    backend: str
    parameters: dict[str, int]  # per top-level child + "total", shared weights once
    gradient_shapes: tuple[tuple[int, ...], ...]
    parameter_dtype_bytes: int
    buffer_bytes: int
    batch_bytes: int
    blocks: tuple[TracedBlock, ...]
    saved: tuple[SavedRecord, ...] = field(repr=False)
    ops: tuple[OpRecord, ...] = field(repr=False)
    events: tuple[StorageEvent, ...] = field(repr=False)
    checkpointed: bool = False
    notes: tuple[str, ...] = ()
    op_blocks: tuple[str, ...] = field(default=(), repr=False)  # the block each op ran for (`_Recorder.block`)
    block_parameters: dict[str, int] = field(default_factory=dict, repr=False)  # parameters per block
    # parameters with requires_grad per block, only when some are frozen (LoRA: planner.adapters.traced)
    block_trainable: dict[str, int] = field(default_factory=dict, repr=False)
    retained_storages: tuple[tuple[str, int], ...] = field(default=(), repr=False)  # (block, storage) of outputs

    @property
    def saved_bytes(self) -> int:
        """Bytes saved for backward by one micro-batch's forward (`MemoryBytes.activations`)."""
        return sum(b.saved_bytes for b in self.blocks)


def _block_order(op_blocks: tuple[str, ...], saved: tuple[SavedRecord, ...], retained: dict[str, int],
                 forward_end: int, backward_end: int) -> list[str]:
    """Blocks in the order the step memory walks them: forward order, except that the blocks backward
    reaches take their places in the reverse of the order backward last reaches them (where their
    gradients are complete and their activations freed: a model's embeddings and pooler share a block,
    whose backward ends at the embeddings).

    Why: a block's backward runs when autograd reaches it, and the timeline frees its activations and counts
    its backward temporaries there. First forward appearance alone misplaces a block whose ops run at
    both ends of the forward: a Hugging Face encoder-decoder's root shifts the labels first and computes the
    logits bias and the loss last (BART, T5), so ordering it first put the loss's backward (the vocabulary-
    sized fp32 gradients) after every layer's activations were freed: BART-base at b16 s512 amp-bf16 was
    1.6 GiB under its measured peak (h200-2026-11-26 traced-memory-sites.txt)."""
    order: list[str] = []
    for i in range(forward_end):
        if op_blocks[i] not in order:
            order.append(op_blocks[i])
    for b in [*(s.block for s in saved), *retained]:
        if b not in order:
            order.append(b)
    last: dict[str, int] = {}
    for i in range(forward_end, backward_end):
        if op_blocks[i] in order:
            last[op_blocks[i]] = i
    slots = [i for i, b in enumerate(order) if b in last]
    for i, b in zip(slots, sorted(last, key=last.__getitem__, reverse=True), strict=True):
        order[i] = b
    return order


def block_memory(events: tuple[StorageEvent, ...], op_blocks: tuple[str, ...], saved: tuple[SavedRecord, ...],
                 parameters: dict[str, int], retained: dict[str, int], forward_end: int, backward_end: int,
                 backend: Backend, retained_ids: frozenset[int]) -> tuple[TracedBlock, ...]:
    """Per block: saved bytes, and the measured transient peaks from replaying the storage events (a pure
    function of the trace's records, so an interpolated trace gets its own: planner.program.scale).

    A transient excludes the model outputs the loop keeps (`retained_ids`, the logits): the timeline counts
    them as activations from the head's forward until the optimizer step (`TracedBlock.retained_bytes`), so
    counting them in a backward transient too counted the logits twice (+n·V·4 bytes in every backward block
    after the head; +2 MB per layer for gpt2-tiny at 4x128). They are subtracted only while alive, so the blocks
    before the head keep their own temporaries."""
    order = _block_order(op_blocks, saved, retained, forward_end, backward_end)
    if LOSS_BLOCK in order:
        order.remove(LOSS_BLOCK)
    order.append(LOSS_BLOCK)
    saved_by: dict[str, int] = {b: 0 for b in order}
    for s in saved:
        saved_by[s.block] += s.device_bytes

    size = {e.storage: cuda.allocation_bytes(e.nbytes, backend) for e in events if e.action == "alloc"}
    cat = {e.storage: e.category for e in events}
    fwd = dict.fromkeys(order, 0)
    bwd = dict.fromkeys(order, 0)
    live = kept = grads = held = 0  # step storages alive; of them saved activations, parameter gradients, outputs
    stream = iter((e.op, e.action, e.storage) for e in events)
    pending = next(stream, None)
    for i in range(backward_end):
        while pending is not None and pending[0] <= i:
            _, action, sid = pending
            sign = 1 if action == "alloc" else -1
            if cat[sid] in ("temporary", "activation", "gradient"):
                live += sign * size[sid]
                if cat[sid] == "activation":
                    kept += sign * size[sid]
                elif cat[sid] == "gradient":
                    grads += sign * size[sid]
                elif sid in retained_ids:
                    held += sign * size[sid]
            pending = next(stream, None)
        block = op_blocks[i] or LOSS_BLOCK
        extra = max(live - kept - grads - held, 0)
        if i < forward_end:
            fwd[block] = max(fwd.get(block, 0), extra)
        else:
            bwd[block] = max(bwd.get(block, 0), extra)
    return tuple(TracedBlock(b, parameters.get(b, 0), saved_by.get(b, 0), max(fwd.get(b, 0), 0), bwd.get(b, 0),
                             retained.get(b, 0)) for b in order)
