"""One training step as a per-tensor trace of allocations and frees, in program order, for `allocator.replay`.

Why: the caching allocator's reserved memory depends on each tensor's size and on the order of allocations
and frees, not on block totals. The trace is built from the same numbers as the block timeline
(`timeline.StepMemory`) and splits each block total into its tensors, so the two agree by construction: the
live bytes at each `Mark` equal `timeline.simulate`'s point of the same label (tests/test_events.py).

Program order: load, then the FIRST step, then the steady step (`first_step=True`, the default; the
marks are the steady step's, the timeline's points):
1. load: each parameter tensor (block order), module buffers, DDP's gradient buckets (first bucket 1 MiB,
   then `bucket_cap_mb`: torch/nn/parallel/distributed.py `_DEFAULT_FIRST_BUCKET_BYTES`).
2. forward: the batch, DataParallel's GPU-0 extra, the cuBLAS workspace at the first matmul (first step
   only); per block its saved tensors (`activations.Saved` records, each rounded to 512 B), its AMP weight
   casts and bias casts (the autocast cache), the logits the loop keeps, and a transient
   (`forward_transient_bytes`, one tensor: APPROXIMATION of the block's unsaved GEMM outputs / upcasts / softmax
   intermediates, a lower bound: tests/test_events_dispatch.py) allocated and freed. A checkpointed block
   keeps only its checkpoint inputs.
3. the autocast cache is freed when autocast exits (end of forward).
4. backward, blocks in reverse: a checkpointed block's recomputed saved tensors, the backward transient
   (one tensor of the block's peak temporaries: exact for transformer layers and the loss against the
   traced autograd peak, tests/test_backward_transients.py; an approximation elsewhere), its gradients (one per parameter tensor; under ZeRO-2/3 one flat shard plus the
   unsharded transient), then its activations are freed.
5. optimizer: in the first step the states, one tensor per state per parameter (Adam `_init_group`), land in
   the activations' freed segments; then the step's temporaries (foreach: one per parameter,
   `torch._foreach_sqrt(exp_avg_sqs)`; otherwise one tensor of `optimizer_temporary_bytes`), freed after the
   step; then the batch and logits; `zero_grad(set_to_none=True)` frees the gradients (grad_accum == 1; with
   accumulation they stay, as the timeline's resident gradients).
Sharded states (ZeRO/FSDP) are one flat tensor per block, as FSDP's FlatParameter and DeepSpeed's
partitions are.

The trace is compact (`Trace`: each tensor's size by id, tensors allocated in id order, ~200 ranges of ids
allocated or freed), and its layout depends only on the step's structure (blocks, checkpointing, first step,
resident gradients, tensors per group): a step whose structure was met before is laid out from it
(`_STRUCTURES`). Why: a search builds a trace per distinct step; this is ~0.1 ms of a cold estimate, not ~1 ms.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from planner.memory import timeline

MiB = 1024 * 1024
# torch/nn/parallel/distributed.py: dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB for the first bucket.
DDP_FIRST_BUCKET_BYTES = 1 * MiB


@dataclass(frozen=True)
class BlockTensors:
    """One block's tensors, bytes each (what splits the timeline's block totals)."""

    name: str
    params: tuple[int, ...] = ()  # parameter tensors (full, unsharded)
    grads: tuple[int, ...] = ()  # gradient tensors (full, unsharded)
    saved: tuple[int, ...] = ()  # activations saved for backward, incl. AMP weight casts
    kept: tuple[int, ...] = ()  # what a checkpointed block keeps (its inputs)
    cache: tuple[int, ...] = ()  # AMP cast cache not saved for backward


@dataclass(frozen=True)
class Mark:
    """After `index` events the live bytes equal the timeline point `label` of `phase`."""

    phase: str
    label: str
    index: int


@dataclass(frozen=True)
class Trace:
    """The step as a compact program: tensor `tid` has `sizes[tid]` bytes and tensors are allocated in id order,
    so the event stream is a few hundred ranges of ids (`program`: start, stop, allocate?) rather than ~4,000
    events. Why: building and replaying the ranges is what keeps an estimate fast (`compiled`); `events` and
    `names` expand it for whoever wants one entry per event or tensor."""

    sizes: tuple[int, ...]  # tensor_id -> bytes requested
    program: tuple[tuple[int, int, bool], ...]  # (first id, stop id, True: allocate / False: free), in order
    group_first: tuple[int, ...]  # first tensor id of each named group (one `alloc` call), ascending
    group_names: tuple[str, ...]
    marks: tuple[Mark, ...]
    permanent: int = -1  # leading events that allocate tensors never freed (-1: unknown, see permanent_prefix)

    @cached_property
    def n_events(self) -> int:
        return sum(b - a for a, b, _ in self.program)

    @property
    def events(self) -> tuple[tuple[int, int], ...]:
        """(tensor_id, nbytes) per event; nbytes == 0 frees it. Expanded on each use, not kept: ~4,000 tuples
        would triple what a cached trace holds."""
        sizes, out = self.sizes, []
        for a, b, alloc in self.program:
            if alloc:
                out.extend(zip(range(a, b), sizes[a:b], strict=True))
            else:
                out.extend((tid, 0) for tid in range(a, b))
        return tuple(out)

    @property
    def names(self) -> tuple[str, ...]:
        """tensor_id -> its group's name."""
        bounds = (*self.group_first[1:], len(self.sizes))
        return tuple(itertools.chain.from_iterable(
            itertools.repeat(name, stop - first) for name, first, stop in zip(self.group_names, self.group_first,
                                                                              bounds, strict=True)))

    @classmethod
    def from_events(cls, events: Sequence[tuple[int, int]], names: Sequence[str], marks: Sequence[Mark] = (),
                    permanent: int = -1) -> Trace:
        """The compact form of an event list whose tensors are allocated in id order from 0 (each tensor its
        own group, named by `names`)."""
        sizes: list[int] = []
        program: list[tuple[int, int, bool]] = []
        for tid, n in events:
            if n:
                if tid != len(sizes):
                    raise ValueError(f"tensor {tid} allocated out of id order (expected {len(sizes)})")
                sizes.append(n)
            _extend(program, tid, tid + 1, bool(n))
        return cls(tuple(sizes), tuple(program), tuple(range(len(sizes))), tuple(names[:len(sizes)]), tuple(marks),
                   permanent)


def _extend(program: list[tuple[int, int, bool]], first: int, stop: int, alloc: bool) -> None:
    """Append a range, merged into the last one when it continues it."""
    if program:
        a, b, kind = program[-1]
        if kind is alloc and b == first:
            program[-1] = (a, stop, alloc)
            return
    program.append((first, stop, alloc))


def split(total: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """`total` as the tensors `sizes` when they add up to it (a remainder becomes one more tensor); one tensor
    of `total` when they do not fit."""
    if total <= 0:
        return ()
    s = sum(sizes)
    if s == total:
        return tuple(sizes)
    if s < total:
        return (*sizes, total - s)
    return (total,)


def buckets(total: int, cap_bytes: int, first_bytes: int = DDP_FIRST_BUCKET_BYTES) -> tuple[int, ...]:
    """DDP's Reducer buckets: the first up to 1 MiB, then up to `bucket_cap_mb` each (approximation: tensors
    are not split across buckets in DDP, so real buckets are a little uneven)."""
    out, left = [], total
    cap = first_bytes
    while left > 0:
        out.append(min(cap, left))
        left -= out[-1]
        cap = cap_bytes
    return tuple(out)


Ranges = list[tuple[int, int]]  # tensor ids [first, stop) of one or more groups


class _Builder:
    """Builds a trace from a table of size tuples (`values`, one per slot: see `_slot_values`); every group
    records the slot it came from, so a step of the same structure reuses the program (`_STRUCTURES`)."""

    def __init__(self, values: Sequence[tuple[int, ...]]) -> None:
        self.values = values
        self.sizes: list[int] = []
        self.program: list[tuple[int, int, bool]] = []
        self.group_first: list[int] = []
        self.group_names: list[str] = []
        self.slots: list[int] = []
        self.marks: list[Mark] = []
        self.n_events = 0

    def alloc(self, name: str, slot: int, suffix: str = "") -> Ranges:
        """One tensor per size of `values[slot]` (positive sizes only: see `_slot_values`), one group named
        `name + suffix` (see `tensor_name`; joined only when the group is not empty); returns its id range."""
        sizes = self.values[slot]
        if not sizes:
            return []
        first = len(self.sizes)
        self.sizes.extend(sizes)
        stop = len(self.sizes)
        self.group_first.append(first)
        self.group_names.append(name + suffix if suffix else name)
        self.slots.append(slot)
        self.n_events += stop - first
        _extend(self.program, first, stop, True)
        return [(first, stop)]

    def free(self, ranges: Ranges) -> None:
        for first, stop in ranges:
            self.n_events += stop - first
            _extend(self.program, first, stop, False)

    def mark(self, phase: str, label: str) -> None:
        self.marks.append(Mark(phase, label, self.n_events))

    def emit(self, part: _Builder, marks: bool) -> int:
        """Append `part` (a builder of its own, ids from 0) here, with its marks if `marks`; returns the id
        offset of its tensors. Why: both steps of a trace run the same blocks, built once (`_blocks_section`)."""
        off, events_before = len(self.sizes), self.n_events
        self.sizes.extend(part.sizes)
        self.group_first.extend([g + off for g in part.group_first])
        self.group_names.extend(part.group_names)
        self.slots.extend(part.slots)
        if part.program:  # its first range may continue the last one here; the others cannot
            first, stop, alloc = part.program[0]
            _extend(self.program, first + off, stop + off, alloc)
            self.program.extend([(a + off, b + off, k) for a, b, k in part.program[1:]])
        if marks:
            self.marks.extend([Mark(m.phase, m.label, m.index + events_before) for m in part.marks])
        self.n_events += part.n_events
        return off

    def trace(self, permanent: int) -> Trace:
        return Trace(tuple(self.sizes), tuple(self.program), tuple(self.group_first), tuple(self.group_names),
                     tuple(self.marks), permanent)


def step_events(step: timeline.StepMemory, tensors: dict[str, BlockTensors] | None = None, *,
                state_sizes: Sequence[int] = (), temp_sizes: Sequence[int] = (),
                bucket_cap_bytes: int = 25 * MiB, first_step: bool = True) -> Trace:
    """The per-tensor trace of `step` (see the module doc). `tensors` splits block totals into tensors (a
    block without an entry is one tensor per total); `state_sizes` / `temp_sizes` split the optimizer's.

    `first_step`: replay the first step before the steady one. Its optimizer step allocates the states
    (Adam `_init_group`: `torch.zeros_like(p)` per tensor) AFTER backward freed the activations, so they land
    in the activations' cached segments, and the next forward needs new segments: the main reason reserved
    exceeds allocated in steady training. Without it, the states are allocated at load (steady state only).
    The marks (timeline points) are those of the steady step."""
    tensors = tensors or {}
    blocks = step.blocks
    bt = [tensors.get(b.name) or BlockTensors(b.name) for b in blocks]
    values = _slot_values(step, bt, state_sizes, temp_sizes, bucket_cap_bytes)
    key = (first_step, step.grads_resident, tuple((b.name, b.checkpointed) for b in blocks),
           tuple(map(len, values)))
    known = _STRUCTURES.get(key)
    if known is not None:  # the same groups in the same order: only the sizes differ
        program, group_first, group_names, marks, permanent, slots = known
        sizes = tuple(itertools.chain.from_iterable([values[k] for k in slots]))
        return Trace(sizes, program, group_first, group_names, marks, permanent)
    trace, slots = _build(step, values, first_step)
    if len(_STRUCTURES) >= STRUCTURE_CACHE_SIZE:
        _STRUCTURES.clear()
    _STRUCTURES[key] = (trace.program, trace.group_first, trace.group_names, trace.marks, trace.permanent, slots)
    return trace


# A step's structure (first step or not, resident gradients, its blocks and checkpointing, how many tensors
# each slot holds) -> the program, groups and marks of its trace, and the slot of each group. A search over
# micro-batch sizes meets one structure many times: its trace is then the slots' sizes in that order.
STRUCTURE_CACHE_SIZE = 1024
_STRUCTURES: dict[tuple, tuple] = {}

# Slots: each block's row of size tuples, then the step's own.
(B_PARAMS, B_GATHERED, B_SAVED, B_KEPT, B_CACHE, B_LOGITS, B_FORWARD_TMP, B_RECOMPUTED, B_BACKWARD_TMP, B_GRADS,
 B_UNSHARDED) = range(11)
BLOCK_SLOTS = 11
S_BUFFERS, S_BUCKETS, S_BATCH, S_EXTRA, S_WORKSPACE, S_STATES, S_TEMPS = range(7)


def _one(nbytes: int) -> tuple[int, ...]:
    """A group of one tensor, or of none when it has no bytes."""
    return (nbytes,) if nbytes > 0 else ()


def _slot_values(step: timeline.StepMemory, bt: list[BlockTensors], state_sizes: Sequence[int],
                 temp_sizes: Sequence[int], bucket_cap_bytes: int) -> list[tuple[int, ...]]:
    """Every group's sizes, by slot: block i's B_* at i * BLOCK_SLOTS, then the step's S_* after the blocks.
    Only tensors that exist: a size of no bytes allocates nothing."""
    raw: list[tuple[int, ...]] = []
    for b, d in zip(step.blocks, bt, strict=True):
        raw += (split(b.param_bytes, d.params if b.param_bytes == sum(d.params) else ()),
                _one(b.gathered_param_bytes),
                split(b.saved_bytes, d.saved),
                split(b.kept_bytes, d.kept),
                split(b.forward_cache_bytes, d.cache),
                _one(b.retained_bytes),
                _one(b.forward_transient_bytes),
                split(b.saved_bytes - b.kept_bytes, _minus(d.saved, d.kept)) if b.checkpointed else (),
                _one(b.backward_transient_bytes),
                split(b.grad_bytes, d.grads if b.grad_bytes == sum(d.grads) else ()),
                _one(b.transient_grad_bytes))
    raw += (_one(step.module_buffer_bytes), buckets(step.ddp_bucket_bytes, bucket_cap_bytes),
            _one(step.batch_bytes), _one(step.extra_forward_bytes), _one(step.workspace_bytes),
            split(step.optimizer_state_bytes, state_sizes), split(step.optimizer_temporary_bytes, temp_sizes))
    # tensors of no bytes inside a split (a zero-size parameter) allocate nothing either
    return [t if len(t) < 2 or min(t) > 0 else tuple(n for n in t if n > 0) for t in raw]


def _build(step: timeline.StepMemory, values: list[tuple[int, ...]], first_step: bool) -> tuple[Trace, tuple]:
    """The trace, group by group (see `step_events`), and the slot of each group."""
    t = _Builder(values)
    top = len(step.blocks) * BLOCK_SLOTS
    for i, b in enumerate(step.blocks):
        t.alloc(b.name, i * BLOCK_SLOTS + B_PARAMS, ".param")
    t.alloc("module buffers", top + S_BUFFERS)
    t.alloc("ddp bucket", top + S_BUCKETS)
    t.mark("load", "after load")
    section = None
    if first_step:
        permanent = t.n_events  # parameters, buffers and buckets live as long as the model
        section = _blocks_section(step, values, new_grads=True)
        _one_step(t, step, first=True, section=section)
        if step.grads_resident:  # the steady step's backward finds the gradients there: a section of its own
            section = None
    else:
        t.alloc("optimizer state", top + S_STATES)
        permanent = t.n_events  # ... and so do the optimizer states
    _one_step(t, step, first=not first_step, marks=True, section=section)
    return t.trace(permanent), tuple(t.slots)


def _blocks_section(step: timeline.StepMemory, values: Sequence[tuple[int, ...]],
                    new_grads: bool) -> tuple[_Builder, Ranges, Ranges]:
    """Forward then backward through the blocks (a builder of its own, ids from 0; marks recorded); returns it
    with the ranges of the gradients it allocates and of the outputs the loop keeps (logits), which the step
    frees after it. `new_grads`: backward allocates the gradients (not resident from earlier micro-steps)."""
    blocks = step.blocks
    t = _Builder(values)
    alloc, free, mark = t.alloc, t.free, t.mark
    live: list[Ranges] = []
    cache_ids: Ranges = []
    retained: Ranges = []
    for i, b in enumerate(blocks):
        name, row = b.name, i * BLOCK_SLOTS
        gathered = alloc(name, row + B_GATHERED, ".gathered params")
        if b.checkpointed:
            ids = alloc(name, row + B_KEPT, ".kept")
        else:
            ids = alloc(name, row + B_SAVED, ".saved")
        live.append(ids)
        cache_ids += alloc(name, row + B_CACHE, ".autocast cache")
        retained += alloc(name, row + B_LOGITS, ".logits")
        tmp = alloc(name, row + B_FORWARD_TMP, ".forward transient")
        mark("forward", name)
        free(tmp)
        free(gathered)
    mark("forward", "end of forward")
    free(cache_ids)

    grad_ids: Ranges = []
    for i in range(len(blocks) - 1, -1, -1):
        b, ids = blocks[i], live[i]
        name, row = b.name, i * BLOCK_SLOTS
        recompute = alloc(name, row + B_RECOMPUTED, ".recomputed") if b.checkpointed else []
        gathered = alloc(name, row + B_GATHERED, ".gathered params")
        tmp = alloc(name, row + B_BACKWARD_TMP, ".backward transient")
        if new_grads:
            grad_ids += alloc(name, row + B_GRADS, ".grad")
        tmp += alloc(name, row + B_UNSHARDED, ".unsharded grad")
        mark("backward", name)
        free(tmp)
        free(gathered)
        free(recompute)
        free(ids)
    return t, grad_ids, retained


def _shift(ranges: Ranges, off: int) -> Ranges:
    return [(a + off, b + off) for a, b in ranges]


def _one_step(t: _Builder, step: timeline.StepMemory, *, first: bool, marks: bool = False,
              section: tuple[_Builder, Ranges, Ranges] | None = None) -> None:
    """One training step's events; `first`: the workspace (and resident gradients) appear here; `marks`:
    record the timeline points (only the steady step); `section`: the blocks' forward and backward when
    already built (`_blocks_section`)."""
    alloc, free = t.alloc, t.free
    top = len(step.blocks) * BLOCK_SLOTS
    batch = alloc("batch", top + S_BATCH)
    extra = alloc("dataparallel gpu0 extra", top + S_EXTRA)
    if step.grads_resident and marks and first:  # steady-state only trace: earlier micro-steps' gradients
        for i, b in enumerate(step.blocks):
            alloc(b.name, i * BLOCK_SLOTS + B_GRADS, ".grad")
    if first:
        alloc("cublas workspace", top + S_WORKSPACE)

    new_grads = not step.grads_resident or not marks  # resident gradients come from the first step
    if section is None:
        section = _blocks_section(step, t.values, new_grads)
    blocks_part, grads, kept = section
    off = t.emit(blocks_part, marks)
    grad_ids, retained = _shift(grads, off), _shift(kept, off)
    free(extra)

    if not marks:  # the first step: Adam's _init_group allocates the states before the update
        alloc("optimizer state", top + S_STATES)
    temps = alloc("optimizer temporary", top + S_TEMPS)
    if marks:
        t.mark("optimizer", "optimizer step")
    free(temps)
    free(batch)
    free(retained)
    if not marks and not step.grads_resident:
        free(grad_ids)  # optimizer.zero_grad(set_to_none=True) before the next forward


def _minus(saved: Sequence[int], kept: Sequence[int]) -> tuple[int, ...]:
    """`saved` without one tensor of each size in `kept` (the recomputed forward reuses its input)."""
    rest = list(saved)
    for k in kept:
        if k in rest:
            rest.remove(k)
    return tuple(rest)


def tensor_name(trace: Trace, tid: int) -> str:
    """`group[k]` for the k-th tensor of a group of several, `group` for a single one."""
    g = bisect_right(trace.group_first, tid) - 1
    first = trace.group_first[g]
    stop = trace.group_first[g + 1] if g + 1 < len(trace.group_first) else len(trace.sizes)
    name = trace.group_names[g]
    return name if stop - first == 1 else f"{name}[{tid - first}]"


def permanent_prefix(trace: Trace) -> int:
    """How many leading events allocate tensors the step never frees (parameters, buffers, buckets, states):
    the allocator state after them depends on the model and optimizer only, so it can be cached."""
    if trace.permanent >= 0:  # known to the builder (step_events)
        return trace.permanent
    freed = {tid for tid, n in trace.events if not n}
    for i, (tid, n) in enumerate(trace.events):
        if not n or tid in freed:
            return i
    return len(trace.events)


def live_bytes(trace: Trace) -> list[int]:
    """Requested bytes alive at each mark (no allocator rounding)."""
    sizes: dict[int, int] = {}
    total, out, marks, m = 0, [], trace.marks, 0
    for i, (tid, n) in enumerate(trace.events):
        while m < len(marks) and marks[m].index == i:
            out.append(total)
            m += 1
        if n:
            sizes[tid] = n
            total += n
        else:
            total -= sizes.pop(tid)
    out += [total] * (len(marks) - m)
    return out


MODEL_CACHE_SIZE = 256  # models whose parameter / gradient tensor bytes are kept
_BLOCK_SHAPES: dict[tuple, tuple] = {}


def model_block_tensors(model, activations, config, parameter_share: float = 1.0,
                        gradient_share: float = 1.0, backend: str = "cuda") -> dict[str, BlockTensors]:
    """Each block's tensors from the analytic core: parameter and gradient tensors from
    `planner.models.params` shapes (unsharded only: a shard is one flat tensor), saved activations and AMP
    casts from `activations.BlockActivations` records, each rounded like the CUDA allocator rounds."""
    from planner.memory import model_states
    from planner.memory.activations import alloc_bytes
    from planner.models.blocks import model_blocks
    from planner.models.params import block_gradient_tensor_shapes, block_tensor_shapes, tied_gradient

    p_bytes = model_states.parameter_dtype_bytes(config.precision)
    g_bytes = model_states.gradient_dtype_bytes(config.precision)
    key = (id(model), p_bytes, g_bytes, parameter_share == 1, gradient_share == 1)
    hit = _BLOCK_SHAPES.get(key)
    if hit is None or hit[0] is not model:
        shapes = {}
        for block in model_blocks(model):
            params = tuple(math.prod(s) * p_bytes for s in block_tensor_shapes(block)) if parameter_share == 1 else ()
            grads = (tuple(math.prod(s) * g_bytes for s in block_gradient_tensor_shapes(block))
                     if gradient_share == 1 else ())
            shapes[block.name] = (params, grads)
        tied = tied_gradient(model) if gradient_share == 1 else None
        if tied is not None:  # the shared table's gradient appears at the head's backward (`tied_gradient`)
            emb, head, shape = tied
            nbytes = math.prod(shape) * g_bytes
            e_params, e_grads = shapes[emb]
            if nbytes in e_grads:
                rest = list(e_grads)
                rest.remove(nbytes)
                shapes[emb] = (e_params, tuple(rest))
                shapes[head] = (shapes[head][0], (*shapes[head][1], nbytes))
        if len(_BLOCK_SHAPES) >= MODEL_CACHE_SIZE:
            _BLOCK_SHAPES.clear()
        hit = _BLOCK_SHAPES[key] = (model, shapes)
    shapes = hit[1]
    memo: dict[int, tuple] = {}  # identical layers share their records' tuples: round each tuple once

    def rounded(tensors: tuple, weight: bool | None = None) -> tuple[int, ...]:
        key = (id(tensors), weight)
        got = memo.get(key)
        if got is None:
            got = memo[key] = tuple(alloc_bytes(t.nbytes, backend) for t in tensors
                                    if weight is None or t.name.startswith("weight") is weight)
        return got

    out = {}
    for act in activations:
        params, grads = shapes.get(act.block, ((), ()))
        weights = rounded(act.cache_tensors, True)
        others = rounded(act.cache_tensors, False)
        saved = rounded(act.tensors) + weights
        kept = rounded(act.kept_tensors)
        out[act.block] = BlockTensors(act.block, params, grads, saved, kept,
                                      weights + others if act.checkpointed else others)
    return out


def optimizer_tensor_sizes(shapes, config, param_bytes: int, share: float = 1.0) -> tuple[tuple[int, ...],
                                                                                           tuple[int, ...]]:
    """(state tensors, step temporaries) per parameter tensor for Adam/AdamW (exp_avg, exp_avg_sq; foreach's
    sqrt list) when unsharded; () otherwise (one tensor of the total)."""
    if share != 1 or config.optimizer not in ("adam", "adamw"):
        return (), ()
    sizes = [math.prod(s) * param_bytes for s in shapes]
    states = tuple(n for n in sizes for _ in range(2))
    temps = tuple(sizes) if config.optimizer_impl == "foreach" else ()
    return states, temps
