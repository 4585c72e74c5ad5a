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
   (the tensors alive at the block's peak temporaries, each its own request: `BlockTensors.backward`,
   `activations.layer_backward_tensors`; their total is exact for transformer layers and the loss against
   the traced autograd peak, tests/test_backward_transients.py; an approximation elsewhere; one tensor of
   the total when the tensors are not known), its gradients (one per parameter tensor; under ZeRO-2/3 one flat shard plus the
   unsharded transient), then its activations are freed.
5. optimizer: in the first step the states, one tensor per state per parameter (Adam `_init_group`), land in
   the activations' freed segments; then the step's temporaries (foreach: one per parameter,
   `torch._foreach_sqrt(exp_avg_sqs)`; otherwise one tensor of `optimizer_temporary_bytes`), freed after the
   step; then the batch and logits; `zero_grad(set_to_none=True)` frees the gradients (grad_accum == 1; with
   accumulation they stay, as the timeline's resident gradients).
Sharded states (ZeRO/FSDP) are one flat tensor per block, as FSDP's FlatParameter and DeepSpeed's
partitions are.

The trace is compact (`Trace`: each tensor's size by id, tensors allocated in id order, ~200 ranges of ids
allocated or freed). The steps above are recorded once per shape (blocks, checkpointing, first step, resident
gradients: `_Program`, `_LAYOUTS`) as ops on slots, each slot a group of tensors (`_slot_values`); how many
tensors each slot holds then lays out every id at once (`_Layout.lay_out`, cached in `_STRUCTURES`). Why: a
search builds a trace per distinct step, and most of its steps differ in parallelism, precision or
accumulation, not in shape: a new step costs ~0.1 ms of slot sizes and one numpy lay-out, not a walk through
the blocks (~0.4 ms for the multimodal model).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

from planner import caches
from planner.memory import timeline

MiB = 1024 * 1024
# The loss's entry in the blocks (`activations.activation_blocks`): its forward transient is cross-entropy's
# input cast (autocast's fp32 copy of the logits), made BEFORE log_softmax's saved output and freed after
# it (the dispatch trace's order), where a layer's transient is its last op's unsaved output.
LOSS = "loss"
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
    backward: tuple[int, ...] = ()  # the backward transient's tensors (`activations.layer_backward_tensors`)

    def __post_init__(self) -> None:
        """A tensor of no bytes (a zero-size parameter) allocates nothing: dropped here, once per block, so
        that no trace built from these tuples has to look for them."""
        if min(self.params + self.grads + self.saved + self.kept + self.cache + self.backward, default=1) <= 0:
            for f in ("params", "grads", "saved", "kept", "cache", "backward"):
                object.__setattr__(self, f, _positive(getattr(self, f)))


# The pseudo-block of a pipeline rank holding the saved activations of its other micro-batches in flight
# (planner.pipeline.step; planner.memory.stages.in_flight counts them)
IN_FLIGHT = "in-flight micro-batches"


def in_flight_tensors(step: timeline.StepMemory, tensors: dict[str, BlockTensors]) -> BlockTensors | None:
    """The in-flight pseudo-block's bytes as the tensors they are: the rank's own blocks' kept tensors of one
    micro-batch, once per other micro-batch in flight (the last one in part), or None without that block.

    Why: the micro-batches a pipeline schedule keeps (Megatron-Core's interleaved 1F1B warm-up) each saved the
    same per-op tensors as the one running; as one tensor of their total (tens of GiB) the replay would need
    one segment that large, which a freed one cut by the optimizer's first allocations can never hold again
    (a second whole segment, a pool the real allocator, carving many ~100 MiB tensors, does not build)."""
    block = next((b for b in step.blocks if b.name == IN_FLIGHT), None)
    if block is None or block.kept_bytes <= 0:
        return None
    one: list[int] = []
    for b in step.blocks:
        d = tensors.get(b.name)
        if d is None or b.name == IN_FLIGHT or b.kept_bytes <= 0:
            continue
        # as the step splits the block itself (`_slot_values`): its saved (or, checkpointed, kept) tensors
        one += split(b.kept_bytes, d.kept if b.checkpointed else d.saved)
    per = sum(one)
    if per <= 0:
        return None
    copies, rest = divmod(block.kept_bytes, per)
    out = one * copies
    for n in one:  # the last micro-batch in part: its first tensors up to the remainder (`split` adds the rest)
        if n > rest:
            break
        out.append(n)
        rest -= n
    return BlockTensors(IN_FLIGHT, saved=tuple(out), kept=tuple(out))


class Mark(NamedTuple):
    """After `index` events the live bytes equal the timeline point `label` of `phase` (a named tuple: a trace
    of a new step makes ~40, at a third of a frozen dataclass's cost)."""

    phase: str
    label: str
    index: int


class Trace:
    """The step as a compact program: tensor `tid` has `sizes[tid]` bytes and tensors are allocated in id order,
    so the event stream is a few hundred ranges of ids (`program`: start, stop, allocate?) rather than ~4,000
    events. Why: building and replaying the ranges is what keeps an estimate fast (`compiled`); `events` and
    `names` expand it for whoever wants one entry per event or tensor.

    A trace laid out by `step_events` makes its tuples (`sizes`, `program`, the groups, the marks) only when
    asked: the compiled replay reads the same numbers as arrays, the peak tensor's name is found in them
    (`group_of`), and a search builds a trace per new step."""

    FIELDS = ("sizes", "program", "group_first", "group_names", "marks", "permanent")

    def __init__(self, sizes: Sequence[int], program: Sequence[tuple[int, int, bool]], group_first: Sequence[int],
                 group_names: Sequence[str], marks: Sequence[Mark], permanent: int = -1) -> None:
        self.sizes = tuple(sizes)  # tensor_id -> bytes requested
        self.program = tuple(program)  # (first id, stop id, True: allocate / False: free), in order
        self.group_first = tuple(group_first)  # first tensor id of each named group (one `alloc` call), ascending
        self.group_names = tuple(group_names)
        self.marks = tuple(marks)
        self.permanent = permanent  # leading events that allocate tensors never freed (-1: unknown)
        self.steady = -1  # events before the steady step (`step_events` with first_step; -1: unknown)

    @classmethod
    def _laid_out(cls, values: Sequence[tuple[int, ...]], laid: _Laid) -> Trace:
        """A trace whose sizes are `values[k]` for k in `laid.slots`, as `_Layout.lay_out` placed them: its
        tuples (sizes, program, groups, marks) are made on first use."""
        trace = cls.__new__(cls)
        trace.__dict__.update(_values=values, _laid=laid, permanent=laid.permanent, steady=laid.steady,
                              n_tensors=laid.n_tensors,
                              n_events=laid.n_events)
        return trace

    def _slot_groups(self) -> list[tuple[int, ...]]:
        """A laid-out trace's sizes, group by group (`__init__` sets `sizes` on any other trace)."""
        values = self.__dict__["_values"]
        return [values[k] for k in self.__dict__["_laid"].slots]

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(itertools.chain.from_iterable(self._slot_groups()))

    @cached_property
    def program(self) -> tuple[tuple[int, int, bool], ...]:  # as `sizes`
        return tuple(zip(*(x.tolist() for x in self.__dict__["_laid"].arrays), strict=True))

    @cached_property
    def group_first(self) -> tuple[int, ...]:  # as `sizes`
        return tuple(self.__dict__["_laid"].group_first.tolist())

    @cached_property
    def group_names(self) -> tuple[str, ...]:  # as `sizes`
        laid = self.__dict__["_laid"]
        names = laid.layout.names
        return tuple([names[op] for op in laid.group_ops.tolist()])

    @cached_property
    def marks(self) -> tuple[Mark, ...]:  # as `sizes`
        laid = self.__dict__["_laid"]
        return tuple(map(Mark, laid.layout.mark_phases, laid.layout.mark_labels, laid.mark_index.tolist()))

    def iter_sizes(self):
        """The sizes in id order, without making the tuple (the compiled replay copies them into an array)."""
        if "sizes" in self.__dict__:
            return iter(self.sizes)
        return itertools.chain.from_iterable(self._slot_groups())

    @cached_property
    def n_tensors(self) -> int:
        return len(self.sizes)

    def group_of(self, tid: int) -> tuple[str, int, int]:
        """(name, first id, stop id) of the group tensor `tid` belongs to."""
        laid = self.__dict__.get("_laid")
        if laid is not None and "group_first" not in self.__dict__:  # without making the groups' tuples
            g = int(laid.group_first.searchsorted(tid, "right")) - 1
            stop = int(laid.group_first[g + 1]) if g + 1 < len(laid.group_first) else self.n_tensors
            return laid.layout.names[int(laid.group_ops[g])], int(laid.group_first[g]), stop
        g = bisect_right(self.group_first, tid) - 1
        stop = self.group_first[g + 1] if g + 1 < len(self.group_first) else self.n_tensors
        return self.group_names[g], self.group_first[g], stop

    def _key(self) -> tuple:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Trace({self.n_tensors} tensors, {self.n_events} events, {len(self.group_first)} groups, "
                f"{len(self.marks)} marks, permanent={self.permanent})")

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
        bounds = (*self.group_first[1:], self.n_tensors)
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


Refs = list[int]  # the ops (indices in a `_Program`) that allocated some groups: what a later free releases

# What a `_Program` op does: allocate one slot's tensors as one group, free the tensors an earlier op allocated,
# record a timeline point, nothing (a point of a step whose points are not recorded), or note that every event
# before it allocates a tensor the step never frees.
ALLOC, FREE, MARK, NOP, PERMANENT, STEADY = range(6)


class _Program:
    """A step's events as ops on slots, before any size is known. Why: the ops depend only on the blocks, their
    checkpointing, the first step and resident gradients (a handful of combinations per search); the slots'
    tensor counts then decide every id at once (`_Layout.lay_out`), so a new combination of sizes, parallelism
    or precision costs no walk through the blocks."""

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.arg: list[int] = []  # ALLOC: its slot; FREE: the op that allocated; MARK: index into `marks`
        self.names: list[str] = []  # ALLOC: its group's name (see `tensor_name`); "" otherwise
        self.marks: list[tuple[str, str]] = []  # (phase, label) per MARK
        self.forward_end = -1  # a blocks section: the op after its forward (`_blocks_section`)

    def _op(self, kind: int, arg: int, name: str = "") -> None:
        self.kind.append(kind)
        self.arg.append(arg)
        self.names.append(name)

    def alloc(self, name: str, slot: int, suffix: str = "") -> Refs:
        """One group of `values[slot]`'s tensors, named `name + suffix` (none when the slot holds none)."""
        self._op(ALLOC, slot, name + suffix if suffix else name)
        return [len(self.kind) - 1]

    def free(self, refs: Refs) -> None:
        for j in refs:
            self._op(FREE, j)

    def mark(self, phase: str, label: str) -> None:
        self._op(MARK, len(self.marks))
        self.marks.append((phase, label))

    def permanent(self) -> None:
        self._op(PERMANENT, 0)

    def steady(self) -> None:
        """Note where the steady step begins (a run replays it once per step: `planner.run.replay`)."""
        self._op(STEADY, 0)

    def emit(self, part: _Program, marks: bool, insert_at: int = -1, frees: Sequence[int] = ()):
        """Append `part` (a program of its own) here, with its marks if `marks`, and FREE ops of `frees` (ops
        already here) before its op `insert_at`; returns the function that maps an op of `part` to its index
        here. Why: both steps of a trace run the same blocks, recorded once (`_blocks_section`)."""
        off, marks_before = len(self.kind), len(self.marks)
        k = len(frees) if insert_at >= 0 else 0

        def shift(j: int) -> int:
            return j + off + (k if 0 <= insert_at <= j else 0)

        for idx, (kind, arg, name) in enumerate(zip(part.kind, part.arg, part.names, strict=True)):
            if idx == insert_at:
                for j in frees:
                    self._op(FREE, j)
            if kind == FREE:
                arg = shift(arg)
            elif kind == MARK:
                kind, arg = (MARK, arg + marks_before) if marks else (NOP, 0)
            self._op(kind, arg, name)
        if insert_at >= len(part.kind):
            for j in frees:
                self._op(FREE, j)
        if marks:
            self.marks.extend(part.marks)
        return shift


class _Layout:
    """A `_Program` as arrays, ready to lay out a step from its slots' tensor counts."""

    def __init__(self, prog: _Program) -> None:
        import numpy as np

        kind = np.array(prog.kind, dtype=np.int64)
        arg = np.array(prog.arg, dtype=np.int64)
        self.n_ops = len(kind)
        self.alloc = kind == ALLOC
        self.alloc_slots = arg[self.alloc]
        self.free = kind == FREE
        self.free_refs = arg[self.free]
        self.mark_ops = np.flatnonzero(kind == MARK)
        marks = [prog.marks[a] for a in arg[self.mark_ops].tolist()]
        self.mark_phases = [phase for phase, _ in marks]
        self.mark_labels = [label for _, label in marks]
        perm = np.flatnonzero(kind == PERMANENT)
        self.permanent_op = int(perm[0]) if len(perm) else -1
        steady = np.flatnonzero(kind == STEADY)
        self.steady_op = int(steady[0]) if len(steady) else -1
        self.names = prog.names

    def lay_out(self, lens) -> _Laid:
        """The trace whose slot k holds `lens[k]` tensors (an int64 array): ids in allocation order, empty
        groups dropped, consecutive ranges of one kind merged (as `_extend` merges them)."""
        import numpy as np

        n = np.zeros(self.n_ops, np.int64)  # events of each op: only ALLOC and FREE ops have any
        first = np.zeros(self.n_ops, np.int64)  # first tensor id of each op's range
        counts = lens[self.alloc_slots]
        n[self.alloc] = counts
        first[self.alloc] = np.cumsum(counts) - counts
        n[self.free] = n[self.free_refs]
        first[self.free] = first[self.free_refs]
        before = np.cumsum(n) - n  # events before each op
        live = np.flatnonzero(n)
        a, b, alloc = first[live], first[live] + n[live], self.alloc[live]
        cont = np.zeros(len(live), np.bool_)
        cont[1:] = (alloc[1:] == alloc[:-1]) & (a[1:] == b[:-1])
        starts = np.flatnonzero(~cont)
        stops = np.append(starts[1:], len(live)) - 1
        groups = np.flatnonzero(self.alloc & (n > 0))
        return _Laid(self, self.alloc_slots[counts > 0].tolist(), (a[starts], b[stops], alloc[starts]),
                     int(counts.sum()), int(n.sum()), int(before[self.permanent_op]) if self.permanent_op >= 0 else -1,
                     first[groups], groups, before[self.mark_ops],
                     int(before[self.steady_op]) if self.steady_op >= 0 else -1)


class _Laid(NamedTuple):
    """What `_Layout.lay_out` makes of a shape and its slots' tensor counts: what a replay reads, and numpy
    arrays that a trace turns into its tuples only when asked (a search replays ~40 new steps and reads the
    groups and marks of none)."""

    layout: _Layout  # the ops' names, mark phases and labels
    slots: list[int]  # the slot of each group, in allocation order
    arrays: tuple  # the program: first ids, stop ids, allocate?
    n_tensors: int
    n_events: int
    permanent: int  # leading events that allocate tensors never freed
    group_first: np.ndarray  # first tensor id of each group (int64)
    group_ops: np.ndarray  # the op that allocates each group, so its name (int64)
    mark_index: np.ndarray  # events before each mark (int64)
    steady: int = -1  # events before the steady step (-1: a trace without a first step)


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
    import numpy as np

    tensors = tensors or {}
    state_sizes, temp_sizes = _positive(state_sizes), _positive(temp_sizes)
    blocks = step.blocks
    bt = [tensors.get(b.name) or BlockTensors(b.name) for b in blocks]
    values = _slot_values(step, bt, state_sizes, temp_sizes, bucket_cap_bytes)
    shape = (first_step, step.grads_resident, tuple((b.name, b.checkpointed, b.root_unit, b.gathered_until_backward)
                                                        for b in blocks), step.outputs_die,
             step.grads_die, bool(step.build_ratio), bool(step.outputs_fp32_bytes), _synced(step))
    lens = tuple(map(len, values))
    key = (shape, lens)
    known = _STRUCTURES.get(key)
    if known is None:
        layout = _LAYOUTS.get(shape)
        if layout is None:
            if len(_LAYOUTS) >= STRUCTURE_CACHE_SIZE:
                _LAYOUTS.clear()
            layout = _LAYOUTS[shape] = _Layout(_record(step, first_step))
        known = layout.lay_out(np.array(lens, dtype=np.int64))
        if len(_STRUCTURES) >= STRUCTURE_CACHE_SIZE:
            _STRUCTURES.clear()
        _STRUCTURES[key] = known
    return Trace._laid_out(values, known)


# A step's shape (first step or not, resident gradients, its blocks and checkpointing) -> its recorded ops as
# arrays (`_LAYOUTS`, a handful per search); the shape and how many tensors each slot holds -> what
# `_Layout.lay_out` makes of it (`_STRUCTURES`: a `_Laid`). A search over micro-batch sizes meets one structure
# many times: its trace is then the slots' sizes in that order.
STRUCTURE_CACHE_SIZE = 1024
_LAYOUTS: dict[tuple, _Layout] = caches.table("planner.memory.events._LAYOUTS", scope="step",
    key="trace structure key -> _Layout")
_STRUCTURES: dict[tuple, _Laid] = caches.table("planner.memory.events._STRUCTURES", scope="step",
    key="(structure, slot sizes) -> _Laid")

# Slots: each block's row of size tuples, then the step's own.
(B_PARAMS, B_GATHERED, B_SAVED, B_KEPT, B_CACHE, B_LOGITS, B_FORWARD_TMP, B_RECOMPUTED, B_BACKWARD_TMP, B_GRADS,
 B_UNSHARDED, B_BUILD, B_SYNCED_GRAD) = range(13)
BLOCK_SLOTS = 13
S_BUFFERS, S_BUCKETS, S_BATCH, S_EXTRA, S_WORKSPACE, S_STATES, S_TEMPS, S_OUTPUTS_FP32 = range(8)


def _positive(sizes: Sequence[int]) -> tuple[int, ...]:
    """`sizes` without the tensors of no bytes (a zero-size parameter's), which allocate nothing."""
    sizes = tuple(sizes)
    return sizes if not sizes or min(sizes) > 0 else tuple(n for n in sizes if n > 0)


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
                split(b.backward_transient_bytes, d.backward),
                split(b.grad_bytes, d.grads if b.grad_bytes == sum(d.grads) else ()),
                _one(b.transient_grad_bytes),
                tuple(n * step.build_ratio for n in split(b.param_bytes, d.params if b.param_bytes == sum(d.params)
                                                           else ())) if step.build_ratio else (),
                _one(b.synced_grad_bytes))
    raw += (_one(step.module_buffer_bytes), buckets(step.ddp_bucket_bytes, bucket_cap_bytes),
            _one(step.batch_bytes), _one(step.extra_forward_bytes), _one(step.workspace_bytes),
            split(step.optimizer_state_bytes, state_sizes), split(step.optimizer_temporary_bytes, temp_sizes),
            _one(step.outputs_fp32_bytes))
    return raw  # no size is <= 0: `_one` and `split` make none, BlockTensors and the optimizer's hold none


def _synced(step: timeline.StepMemory) -> bool:
    """FSDP1's no_sync() accumulation (timeline.BlockMemory.synced_grad_bytes): the last micro-step's
    reduce-scatters replace the whole gradients by their shards before the optimizer step."""
    return step.grads_resident and any(b.synced_grad_bytes >= 0 for b in step.blocks)


def _record(step: timeline.StepMemory, first_step: bool) -> _Program:
    """The step's ops, group by group (see `step_events`); reads only the structure of `step`."""
    t = _Program()
    top = len(step.blocks) * BLOCK_SLOTS
    if step.build_ratio:  # --load cast: the fp32 build, then `model.to(dtype)` block by block (loops.build_ratio)
        builds = [t.alloc(b.name, i * BLOCK_SLOTS + B_BUILD, ".fp32 build") for i, b in enumerate(step.blocks)]
        t.mark("load", "fp32 build")
        for i, b in enumerate(step.blocks):
            t.alloc(b.name, i * BLOCK_SLOTS + B_PARAMS, ".param")
            t.free(builds[i])
    else:
        for i, b in enumerate(step.blocks):
            t.alloc(b.name, i * BLOCK_SLOTS + B_PARAMS, ".param")
    t.alloc("module buffers", top + S_BUFFERS)
    t.alloc("ddp bucket", top + S_BUCKETS)
    t.mark("load", "after load")
    section = None
    carried: Refs = []
    if first_step:
        if not step.build_ratio:  # (after a cast, freed fp32 blocks lie among the parameters: no snapshot)
            t.permanent()  # parameters, buffers and buckets live as long as the model
        section = _blocks_section(step, new_grads=True)
        carried = _one_step(t, step, first=True, section=section)
        if step.grads_resident:  # the steady step's backward finds the gradients there: a section of its own
            section = None
        t.steady()
    else:
        t.alloc("optimizer state", top + S_STATES)
        if not step.build_ratio:
            t.permanent()  # ... and so do the optimizer states
        carried = _carried_in(t, step)
    _one_step(t, step, first=not first_step, marks=True, section=section, carried=carried)
    return t


def _carried_in(t: _Program, step: timeline.StepMemory) -> Refs:
    """A steady-state-only trace: what the previous step's loop leaves alive into this forward
    (planner.memory.loops), allocated at its start."""
    refs: Refs = []
    if step.outputs_die == "next-forward":
        for i, b in enumerate(step.blocks):
            refs += t.alloc(b.name, i * BLOCK_SLOTS + B_LOGITS, ".previous logits")
    if step.grads_die == "next-backward" and not step.grads_resident:
        for i, b in enumerate(step.blocks):
            refs += t.alloc(b.name, i * BLOCK_SLOTS + B_GRADS, ".previous grad")
    return refs


def _blocks_section(step: timeline.StepMemory, new_grads: bool) -> tuple[_Program, Refs, Refs]:
    """Forward then backward through the blocks (a program of its own; marks recorded); returns it with the
    ops that allocate the gradients and the outputs the loop keeps (logits), which the step frees after it.
    `new_grads`: backward allocates the gradients (not resident from earlier micro-steps)."""
    blocks = step.blocks
    t = _Program()
    alloc, free, mark = t.alloc, t.free, t.mark
    live: list[Refs] = []
    cache_ids: Refs = []
    retained: Refs = []
    # FSDP1's root unit (timeline.BlockMemory.root_unit): unsharded from the forward's start to the backward's end
    root = [i for i, b in enumerate(blocks) if b.root_unit]
    root_params: Refs = []
    for i in root:
        root_params += alloc(blocks[i].name, i * BLOCK_SLOTS + B_GATHERED, ".gathered params (root unit)")
    held: dict[int, Refs] = {}  # units gathered until their backward (BlockMemory.gathered_until_backward)
    for i, b in enumerate(blocks):
        name, row = b.name, i * BLOCK_SLOTS
        gathered = [] if b.root_unit else alloc(name, row + B_GATHERED, ".gathered params")
        tmp = alloc(name, row + B_FORWARD_TMP, ".forward transient") if name == LOSS else []
        if b.checkpointed:
            ids = alloc(name, row + B_KEPT, ".kept")
        else:
            ids = alloc(name, row + B_SAVED, ".saved")
        live.append(ids)
        cache_ids += alloc(name, row + B_CACHE, ".autocast cache")
        retained += alloc(name, row + B_LOGITS, ".logits")
        if name != LOSS:
            tmp = alloc(name, row + B_FORWARD_TMP, ".forward transient")
        mark("forward", name)
        free(tmp)
        if b.gathered_until_backward:
            held[i] = gathered
        else:
            free(gathered)
    top = len(blocks) * BLOCK_SLOTS
    converted = alloc("outputs.fp32 copy", top + S_OUTPUTS_FP32)  # Accelerate's convert_outputs_to_fp32
    mark("forward", "end of forward")
    free(converted)
    free(cache_ids)
    t.forward_end = len(t.kind)  # where the previous step's carried tensors die (`_one_step`)
    if step.outputs_die == "forward-end":  # the loop returned only the loss (planner.memory.loops)
        free(retained)
        retained = []

    grad_ids: Refs = []
    root_grads: Refs = []
    for i in range(len(blocks) - 1, -1, -1):
        b, ids = blocks[i], live[i]
        name, row = b.name, i * BLOCK_SLOTS
        recompute = alloc(name, row + B_RECOMPUTED, ".recomputed") if b.checkpointed else []
        if i in held:
            gathered = held.pop(i)
        else:
            gathered = [] if b.root_unit else alloc(name, row + B_GATHERED, ".gathered params")
        tmp = alloc(name, row + B_BACKWARD_TMP, ".backward transient")
        if new_grads:
            grad_ids += alloc(name, row + B_GRADS, ".grad")
        if not b.root_unit:
            tmp += alloc(name, row + B_UNSHARDED, ".unsharded grad")
        else:  # the root's gradient, each block's part from its own backward (timeline._rows says why)
            root_grads += alloc(name, row + B_UNSHARDED, ".unsharded grad (root unit)")
        mark("backward", name)
        free(tmp)
        free(gathered)
        free(recompute)
        free(ids)
    free(root_grads)
    free(root_params)
    return t, grad_ids, retained


def _shift(refs: Refs, off: int) -> Refs:
    return [j + off for j in refs]


def _one_step(t: _Program, step: timeline.StepMemory, *, first: bool, marks: bool = False,
              section: tuple[_Program, Refs, Refs] | None = None, carried: Refs = ()) -> Refs:
    """One training step's ops; `first`: the workspace (and resident gradients) appear here; `marks`:
    record the timeline points (only the steady step); `section`: the blocks' forward and backward when
    already recorded (`_blocks_section`); `carried`: ops of the previous step whose tensors the loop frees
    when this forward ends (planner.memory.loops). Returns this step's such ops."""
    alloc, free = t.alloc, t.free
    top = len(step.blocks) * BLOCK_SLOTS
    batch = alloc("batch", top + S_BATCH)
    extra = alloc("dataparallel gpu0 extra", top + S_EXTRA)
    synced = _synced(step)
    resident: Refs = []
    # steady-state only trace: earlier micro-steps' gradients; after a synced step (the shards freed by
    # zero_grad) the micro-steps before this one's last made whole gradients again
    if step.grads_resident and marks and (first or synced):
        for i, b in enumerate(step.blocks):
            resident += alloc(b.name, i * BLOCK_SLOTS + B_GRADS, ".grad")
    if first:
        alloc("cublas workspace", top + S_WORKSPACE)

    new_grads = not step.grads_resident or not marks  # resident gradients come from the first step
    if section is None:
        section = _blocks_section(step, new_grads)
    blocks_part, grads, kept = section
    at = blocks_part.forward_end if carried else -1
    shift = t.emit(blocks_part, marks, insert_at=at, frees=carried)
    grad_ids, retained = [shift(j) for j in grads], [shift(j) for j in kept]
    free(extra)
    shards: Refs = []
    if synced:  # the last micro-step's reduce-scatters: each whole gradient gives way to its fp32 shard
        for i, b in enumerate(step.blocks):
            shards += alloc(b.name, i * BLOCK_SLOTS + B_SYNCED_GRAD, ".grad shard")
        free(grad_ids if new_grads else resident)

    if not marks:  # the first step: Adam's _init_group allocates the states before the update
        alloc("optimizer state", top + S_STATES)
    temps = alloc("optimizer temporary", top + S_TEMPS)
    if marks:
        t.mark("optimizer", "optimizer step")
    free(temps)
    free(batch)
    out: Refs = []
    if step.outputs_die == "next-forward" and not marks:
        out += retained  # rebound when the next forward returns
    else:
        free(retained)
    free(shards)  # zero_grad(set_to_none=True); the next micro-steps make whole gradients again
    if not marks and not step.grads_resident:
        if step.grads_die == "next-backward":
            out += grad_ids  # zeroed after the next forward, before its backward
        else:
            free(grad_ids)  # optimizer.zero_grad(set_to_none=True) before the next forward
    return out


def _minus(saved: Sequence[int], kept: Sequence[int]) -> tuple[int, ...]:
    """`saved` without one tensor of each size in `kept` (the recomputed forward reuses its input)."""
    rest = list(saved)
    for k in kept:
        if k in rest:
            rest.remove(k)
    return tuple(rest)


def tensor_name(trace: Trace, tid: int) -> str:
    """`group[k]` for the k-th tensor of a group of several, `group` for a single one."""
    name, first, stop = trace.group_of(tid)
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
_BLOCK_SHAPES: dict[tuple, tuple] = caches.table("planner.memory.events._BLOCK_SHAPES", scope="model",
    key="(model identity, dtypes) -> parameter / gradient tensor bytes per block")
# Each block's tensors by model, activation records (one object per shape: `estimate._activations`), dtypes,
# shares and backend: a search meets one shape under several parallelisms and instance counts. Callers must
# not change the dicts they get.
ACTIVATIONS_CACHE_SIZE = 4096
_BLOCK_TENSORS: dict[tuple, tuple] = caches.table("planner.memory.events._BLOCK_TENSORS", scope="step",
    key="(model, activation records, dtypes, shares, backend) -> each block's tensors")


def model_block_tensors(model, activations, config, parameter_share: float = 1.0,
                        gradient_share: float = 1.0, backend: str = "cuda") -> dict[str, BlockTensors]:
    """Each block's tensors from the analytic core: parameter and gradient tensors from
    `planner.models.params` shapes (unsharded only: a shard is one flat tensor), saved activations and AMP
    casts from `activations.BlockActivations` records, each rounded like the CUDA allocator rounds."""
    from planner.memory import model_states
    from planner.models.blocks import model_blocks
    from planner.models.params import block_gradient_tensor_shapes, block_tensor_shapes, tied_gradient

    p_bytes = model_states.parameter_dtype_bytes(config.precision)
    g_bytes = model_states.gradient_dtype_bytes(config.precision)
    key = (id(model), p_bytes, g_bytes, parameter_share == 1, gradient_share == 1)
    done_key = (*key, id(activations), backend)
    done = _BLOCK_TENSORS.get(done_key)
    if done is not None and done[0] is model and done[1] is activations:
        return done[2]
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
    out = {}
    for block, (saved, kept, cache, backward) in _rounded_activations(activations, backend).items():
        params, grads = shapes.get(block, ((), ()))
        out[block] = BlockTensors(block, params, grads, saved, kept, cache, backward)
    if isinstance(activations, tuple):  # immutable: safe to key by identity while the cache holds it
        if len(_BLOCK_TENSORS) >= ACTIVATIONS_CACHE_SIZE:
            _BLOCK_TENSORS.clear()
        _BLOCK_TENSORS[done_key] = (model, activations, out)
    return out


_ROUNDED: dict[tuple, tuple] = caches.table("planner.memory.events._ROUNDED", scope="step",
    key="(id(activations), backend) -> rounded activation records")  # (id(activations), backend) -> (activations, `_rounded_activations`)


def _rounded_activations(activations, backend: str) -> dict[str, tuple]:
    """Per block: (saved, kept, cast cache not saved for backward, backward temporaries), each tensor's bytes
    rounded like the CUDA allocator rounds them (the backward temporaries come rounded). Cached per activation records: a search meets one shape under
    several parallelisms, whose parameter and gradient tensors differ but whose activations do not."""
    from planner.memory.activations import alloc_bytes

    key = (id(activations), backend)
    hit = _ROUNDED.get(key)
    if hit is not None and hit[0] is activations:
        return hit[1]
    memo: dict[tuple, tuple[int, ...]] = {}  # identical layers share their records' tuples: round each once

    def rounded(tensors: tuple, weight: bool | None = None) -> tuple[int, ...]:
        key = (id(tensors), weight)
        got = memo.get(key)
        if got is None:
            got = memo[key] = tuple(alloc_bytes(t.nbytes, backend) for t in tensors
                                    if weight is None or t.name.startswith("weight") is weight)
        return got

    rows = {}
    for act in activations:
        weights = rounded(act.cache_tensors, True)
        others = rounded(act.cache_tensors, False)
        rows[act.block] = (rounded(act.tensors) + weights, rounded(act.kept_tensors),
                           weights + others if act.checkpointed else others, act.backward_tensors)
    if isinstance(activations, tuple):  # immutable: safe to key by identity while the cache holds it
        if len(_ROUNDED) >= ACTIVATIONS_CACHE_SIZE:
            _ROUNDED.clear()
        _ROUNDED[key] = (activations, rows)
    return rows


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
