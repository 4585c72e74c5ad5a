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
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.program: list[tuple[int, int, bool]] = []
        self.group_first: list[int] = []
        self.group_names: list[str] = []
        self.marks: list[Mark] = []
        self.n_events = 0

    def alloc(self, name: str, sizes: Sequence[int], suffix: str = "") -> Ranges:
        """One tensor per positive size, one group named `name + suffix` (see `tensor_name`; joined only when
        the group is not empty); returns its id range."""
        first = len(self.sizes)
        if len(sizes) == 1:  # most groups are one tensor
            if sizes[0] <= 0:
                return []
            self.sizes.append(sizes[0])
        elif sizes and min(sizes) > 0:
            self.sizes.extend(sizes)
        else:
            self.sizes.extend(n for n in sizes if n > 0)
        stop = len(self.sizes)
        if stop == first:
            return []
        self.group_first.append(first)
        self.group_names.append(name + suffix if suffix else name)
        self.n_events += stop - first
        program = self.program
        if program and program[-1][2] and program[-1][1] == first:  # `_extend`, inlined: the hot path
            program[-1] = (program[-1][0], stop, True)
        else:
            program.append((first, stop, True))
        return [(first, stop)]

    def free(self, ranges: Ranges) -> None:
        program = self.program
        for first, stop in ranges:
            self.n_events += stop - first
            if program and not program[-1][2] and program[-1][1] == first:
                program[-1] = (program[-1][0], stop, False)
            else:
                program.append((first, stop, False))

    def mark(self, phase: str, label: str) -> None:
        self.marks.append(Mark(phase, label, self.n_events))

    def emit(self, part: _Builder, marks: bool) -> int:
        """Append `part` (a builder of its own, ids from 0) here, with its marks if `marks`; returns the id
        offset of its tensors. Why: both steps of a trace run the same blocks, built once (`_blocks_section`)."""
        off, events_before = len(self.sizes), self.n_events
        self.sizes.extend(part.sizes)
        self.group_first.extend([g + off for g in part.group_first])
        self.group_names.extend(part.group_names)
        program = self.program
        rest = part.program
        if rest:
            first, stop, alloc = rest[0]
            if program and program[-1][2] is alloc and program[-1][1] == first + off:  # continues the last range
                program[-1] = (program[-1][0], stop + off, alloc)
                rest = rest[1:]
            program.extend([(a + off, b + off, k) for a, b, k in rest])
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
    t = _Builder()
    blocks = step.blocks
    bt = [tensors.get(b.name) or BlockTensors(b.name) for b in blocks]
    for b, d in zip(blocks, bt, strict=True):
        t.alloc(b.name, split(b.param_bytes, d.params if b.param_bytes == sum(d.params) else ()), ".param")
    t.alloc("module buffers", (step.module_buffer_bytes,))
    t.alloc("ddp bucket", buckets(step.ddp_bucket_bytes, bucket_cap_bytes))
    t.mark("load", "after load")
    states = split(step.optimizer_state_bytes, state_sizes)
    parts = [_split_block(b, d) for b, d in zip(blocks, bt, strict=True)]
    section = None
    if first_step:
        permanent = t.n_events  # parameters, buffers and buckets live as long as the model
        section = _blocks_section(step, parts, new_grads=True)
        _one_step(t, step, parts, states, temp_sizes, first=True, section=section)
        if step.grads_resident:  # the steady step's backward finds the gradients there: a section of its own
            section = None
    else:
        t.alloc("optimizer state", states)
        permanent = t.n_events  # ... and so do the optimizer states
    _one_step(t, step, parts, states, temp_sizes, first=not first_step, marks=True, section=section)
    return t.trace(permanent)


@dataclass(frozen=True)
class _Split:
    """One block's totals split into tensors, computed once for both steps of the trace."""

    saved: tuple[int, ...]
    kept: tuple[int, ...]
    cache: tuple[int, ...]
    recomputed: tuple[int, ...]
    grads: tuple[int, ...]


def _split_block(b: timeline.BlockMemory, d: BlockTensors) -> _Split:
    return _Split(split(b.saved_bytes, d.saved), split(b.kept_bytes, d.kept), split(b.forward_cache_bytes, d.cache),
                  split(b.saved_bytes - b.kept_bytes, _minus(d.saved, d.kept)) if b.checkpointed else (),
                  split(b.grad_bytes, d.grads if b.grad_bytes == sum(d.grads) else ()))


def _blocks_section(step: timeline.StepMemory, parts: Sequence[_Split],
                    new_grads: bool) -> tuple[_Builder, Ranges, Ranges]:
    """Forward then backward through the blocks (a builder of its own, ids from 0; marks recorded); returns it
    with the ranges of the gradients it allocates and of the outputs the loop keeps (logits), which the step
    frees after it. `new_grads`: backward allocates the gradients (not resident from earlier micro-steps)."""
    blocks = step.blocks
    t = _Builder()
    alloc, free, mark = t.alloc, t.free, t.mark
    live: list[Ranges] = []
    cache_ids: Ranges = []
    retained: Ranges = []
    for b, x in zip(blocks, parts, strict=True):
        name = b.name
        gathered = alloc(name, (b.gathered_param_bytes,), ".gathered params")
        if b.checkpointed:
            ids = alloc(name, x.kept, ".kept")
        else:
            ids = alloc(name, x.saved, ".saved")
        live.append(ids)
        cache_ids += alloc(name, x.cache, ".autocast cache")
        retained += alloc(name, (b.retained_bytes,), ".logits")
        tmp = alloc(name, (b.forward_transient_bytes,), ".forward transient")
        mark("forward", name)
        free(tmp)
        free(gathered)
    mark("forward", "end of forward")
    free(cache_ids)

    grad_ids: Ranges = []
    for b, x, ids in zip(reversed(blocks), reversed(parts), reversed(live), strict=True):
        name = b.name
        recompute = alloc(name, x.recomputed, ".recomputed") if b.checkpointed else []
        gathered = alloc(name, (b.gathered_param_bytes,), ".gathered params")
        tmp = alloc(name, (b.backward_transient_bytes,), ".backward transient")
        if new_grads:
            grad_ids += alloc(name, x.grads, ".grad")
        tmp += alloc(name, (b.transient_grad_bytes,), ".unsharded grad")
        mark("backward", name)
        free(tmp)
        free(gathered)
        free(recompute)
        free(ids)
    return t, grad_ids, retained


def _shift(ranges: Ranges, off: int) -> Ranges:
    return [(a + off, b + off) for a, b in ranges]


def _one_step(t: _Builder, step: timeline.StepMemory, parts: Sequence[_Split], states: Sequence[int],
              temp_sizes: Sequence[int], *, first: bool, marks: bool = False,
              section: tuple[_Builder, Ranges, Ranges] | None = None) -> None:
    """One training step's events; `parts`: each block's tensors (`_split_block`); `first`: the workspace (and
    resident gradients) appear here; `marks`: record the timeline points (only the steady step); `section`:
    the blocks' forward and backward when already built (`_blocks_section`)."""
    alloc, free = t.alloc, t.free
    batch = alloc("batch", (step.batch_bytes,))
    extra = alloc("dataparallel gpu0 extra", (step.extra_forward_bytes,))
    if step.grads_resident and marks and first:  # steady-state only trace: earlier micro-steps' gradients
        for b, x in zip(step.blocks, parts, strict=True):
            alloc(b.name, x.grads, ".grad")
    if first:
        alloc("cublas workspace", (step.workspace_bytes,))

    new_grads = not step.grads_resident or not marks  # resident gradients come from the first step
    if section is None:
        section = _blocks_section(step, parts, new_grads)
    blocks_part, grads, kept = section
    off = t.emit(blocks_part, marks)
    grad_ids, retained = _shift(grads, off), _shift(kept, off)
    free(extra)

    if not marks:  # the first step: Adam's _init_group allocates the states before the update
        alloc("optimizer state", states)
    temps = alloc("optimizer temporary", split(step.optimizer_temporary_bytes, temp_sizes))
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
