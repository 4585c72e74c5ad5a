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

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
    events: tuple[tuple[int, int], ...]  # (tensor_id, nbytes); nbytes == 0 frees it
    names: tuple[str, ...]  # tensor_id -> name
    marks: tuple[Mark, ...]
    permanent: int = -1  # leading events that allocate tensors never freed (-1: unknown, see permanent_prefix)


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


class _Builder:
    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.names: list[str] = []
        self.marks: list[Mark] = []

    def alloc(self, name: str, sizes: Sequence[int]) -> list[int]:
        """One tensor per positive size; every tensor of the group is named `name` (see `tensor_name`)."""
        first = len(self.names)
        if len(sizes) == 1:  # most groups are one tensor
            n = sizes[0]
            if n <= 0:
                return []
            self.names.append(name)
            self.events.append((first, n))
            return [first]
        sizes = [n for n in sizes if n > 0]
        ids = list(range(first, first + len(sizes)))
        self.names.extend([name] * len(sizes))
        self.events.extend(zip(ids, sizes, strict=True))
        return ids

    def free(self, ids: Sequence[int]) -> None:
        self.events.extend([(tid, 0) for tid in ids])

    def mark(self, phase: str, label: str) -> None:
        self.marks.append(Mark(phase, label, len(self.events)))


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
        t.alloc(f"{b.name}.param", split(b.param_bytes, d.params if b.param_bytes == sum(d.params) else ()))
    t.alloc("module buffers", (step.module_buffer_bytes,))
    t.alloc("ddp bucket", buckets(step.ddp_bucket_bytes, bucket_cap_bytes))
    t.mark("load", "after load")
    states = split(step.optimizer_state_bytes, state_sizes)
    if first_step:
        permanent = len(t.events)  # parameters, buffers and buckets live as long as the model
        _one_step(t, step, bt, states, temp_sizes, first=True)
    else:
        t.alloc("optimizer state", states)
        permanent = len(t.events)  # ... and so do the optimizer states
    _one_step(t, step, bt, states, temp_sizes, first=not first_step, marks=True)
    return Trace(tuple(t.events), tuple(t.names), tuple(t.marks), permanent)


def _one_step(t: _Builder, step: timeline.StepMemory, bt: list[BlockTensors], states: Sequence[int],
              temp_sizes: Sequence[int], *, first: bool, marks: bool = False) -> None:
    """One training step's events; `first`: the workspace (and resident gradients) appear here;
    `marks`: record the timeline points (only the steady step)."""
    blocks = step.blocks
    mark = t.mark if marks else (lambda phase, label: None)
    batch = t.alloc("batch", (step.batch_bytes,))
    extra = t.alloc("dataparallel gpu0 extra", (step.extra_forward_bytes,))

    def grads(b: timeline.BlockMemory, d: BlockTensors) -> list[int]:
        return t.alloc(f"{b.name}.grad", split(b.grad_bytes, d.grads if b.grad_bytes == sum(d.grads) else ()))

    grad_ids: list[int] = []
    if step.grads_resident and marks and first:  # steady-state only trace: earlier micro-steps' gradients
        for b, d in zip(blocks, bt, strict=True):
            grads(b, d)
    if first:
        t.alloc("cublas workspace", (step.workspace_bytes,))

    live: list[list[int]] = []
    cache_ids: list[int] = []
    retained: list[int] = []
    for b, d in zip(blocks, bt, strict=True):
        gathered = t.alloc(f"{b.name}.gathered params", (b.gathered_param_bytes,))
        if b.checkpointed:
            ids = t.alloc(f"{b.name}.kept", split(b.kept_bytes, d.kept))
        else:
            ids = t.alloc(f"{b.name}.saved", split(b.saved_bytes, d.saved))
        live.append(ids)
        cache_ids += t.alloc(f"{b.name}.autocast cache", split(b.forward_cache_bytes, d.cache))
        retained += t.alloc(f"{b.name}.logits", (b.retained_bytes,))
        tmp = t.alloc(f"{b.name}.forward transient", (b.forward_transient_bytes,))
        mark("forward", b.name)
        t.free(tmp)
        t.free(gathered)
    mark("forward", "end of forward")
    t.free(cache_ids)

    new_grads = not step.grads_resident or not marks  # resident gradients come from the first step
    for b, d, ids in zip(reversed(blocks), reversed(bt), reversed(live), strict=True):
        recompute = []
        if b.checkpointed:
            recompute = t.alloc(f"{b.name}.recomputed", split(b.saved_bytes - b.kept_bytes, _minus(d.saved, d.kept)))
        gathered = t.alloc(f"{b.name}.gathered params", (b.gathered_param_bytes,))
        tmp = t.alloc(f"{b.name}.backward transient", (b.backward_transient_bytes,))
        if new_grads:
            grad_ids += grads(b, d)
        tmp += t.alloc(f"{b.name}.unsharded grad", (b.transient_grad_bytes,))
        mark("backward", b.name)
        t.free(tmp)
        t.free(gathered)
        t.free(recompute)
        t.free(ids)
    t.free(extra)

    if not marks:  # the first step: Adam's _init_group allocates the states before the update
        t.alloc("optimizer state", states)
    temps = t.alloc("optimizer temporary", split(step.optimizer_temporary_bytes, temp_sizes))
    mark("optimizer", "optimizer step")
    t.free(temps)
    t.free(batch)
    t.free(retained)
    if not marks and not step.grads_resident:
        t.free(grad_ids)  # optimizer.zero_grad(set_to_none=True) before the next forward


def _minus(saved: Sequence[int], kept: Sequence[int]) -> tuple[int, ...]:
    """`saved` without one tensor of each size in `kept` (the recomputed forward reuses its input)."""
    rest = list(saved)
    for k in kept:
        if k in rest:
            rest.remove(k)
    return tuple(rest)


def tensor_name(trace: Trace, tid: int) -> str:
    """`group[k]` for the k-th tensor of a group of several, `group` for a single one."""
    names = trace.names
    name = names[tid]
    first = tid
    while first > 0 and names[first - 1] is name:
        first -= 1
    last = tid
    while last + 1 < len(names) and names[last + 1] is name:
        last += 1
    return name if first == last else f"{name}[{tid - first}]"


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
    out = {}
    for act in activations:
        params, grads = shapes.get(act.block, ((), ()))
        weights = tuple(alloc_bytes(t.nbytes, backend) for t in act.cache_tensors if t.name.startswith("weight"))
        others = tuple(alloc_bytes(t.nbytes, backend) for t in act.cache_tensors if not t.name.startswith("weight"))
        saved = tuple(alloc_bytes(t.nbytes, backend) for t in act.tensors) + weights
        kept = tuple(alloc_bytes(t.nbytes, backend) for t in act.kept_tensors)
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
